"""Two network namespaces joined through this one by veth links, for the network-fault tests and
bench/net_faults.py (needs root and iproute2's ``ip``)::

    ranks namespace            this (root) namespace              collector namespace
    ranks_ip  <--- veth ---> ranks_gw    [fault proxy]   coll_gw <--- veth ---> coll_ip

The ranks reach the collector only through the proxy on ``ranks_gw`` (no routes between the two
namespaces). ``partition()`` takes the ranks' link down (packets vanish both ways, no FIN, no
RST: the sockets on both sides stay open) and ``heal()`` brings it back. Each namespace has its own
loopback (gloo's rendezvous on 127.0.0.1 stays inside the ranks' namespace). Names and addresses
(100.64.0.0/10) are derived from the process id, so concurrent runs do not meet.
"""

import os
import shutil
import subprocess


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason():
    """None when namespaces and veth links can be made here, else why not (for pytest.skip)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed (./run setup installs it)"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    probe = f"rsprobe{os.getpid() % 100000}"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"ip netns add failed: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Namespaces:
    def __init__(self):
        tag = os.getpid() % 100000
        self.ranks_ns = f"rsr{tag}"
        self.coll_ns = f"rsc{tag}"
        self._ranks_root, self._ranks_peer = f"rsr{tag}a", f"rsr{tag}b"
        self._coll_root, self._coll_peer = f"rsc{tag}a", f"rsc{tag}b"
        net = f"100.{64 + (os.getpid() >> 8) % 64}.{os.getpid() % 256}"
        self.ranks_gw, self.ranks_ip = f"{net}.1", f"{net}.2"
        self.coll_gw, self.coll_ip = f"{net}.5", f"{net}.6"

    def create(self) -> "Namespaces":
        self.destroy()
        for ns, root, peer, gw, addr in (
            (self.ranks_ns, self._ranks_root, self._ranks_peer, self.ranks_gw, self.ranks_ip),
            (self.coll_ns, self._coll_root, self._coll_peer, self.coll_gw, self.coll_ip),
        ):
            _ip("netns", "add", ns)
            _ip("link", "add", root, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("addr", "add", f"{gw}/30", "dev", root)
            _ip("link", "set", root, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", peer)
            _ip("-n", ns, "link", "set", peer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def prefix(self, ns: str) -> list:
        """The command prefix that runs a program in namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def partition(self) -> None:
        """The ranks' link down: nothing passes either way until heal()."""
        _ip("link", "set", self._ranks_root, "down")

    def heal(self) -> None:
        _ip("link", "set", self._ranks_root, "up")

    def destroy(self) -> None:
        for ns, root in ((self.ranks_ns, self._ranks_root), (self.coll_ns, self._coll_root)):
            _ip("link", "del", root, check=False)  # deletes its peer too
            _ip("netns", "del", ns, check=False)
