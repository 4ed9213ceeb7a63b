"""Network faults between the ranks' host and the collector's, the short slice of
bench/net_faults.py: two real DDP ranks (gloo, the real shim) in one network namespace, the real
collector in another, joined through this namespace by veth links and a fault-injecting TCP proxy
(fault_proxy.py). One run trains through, in turn: a partition (the ranks' link down, no FIN, no
RST), every connection reset mid-stream, and a blackhole (reconnects accepted, nothing answered).

What must hold once the network heals: every step stored exactly once, from both ranks; nothing
dropped; each rank reconnected. The ranks' step time in each phase is reported next to the clean
phase's (a ratio, not an assertion: timing is the bench's, docs/reliability.md). Each fault is
known to have taken effect from what the proxy and the ranks saw, never from a sleep.

Skips unless network namespaces can be made (root and iproute2; CI runs as root).
"""

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Collector, child_pythonpath, wait_until
from fault_proxy import FaultProxy
import netns

pytest.importorskip("rankscope._native")

WORLD = 2
PHASE_STEPS = 15  # steps each phase trains at least
PARTITION_STEPS = 200  # seconds of training with the link down (~8 ms a step here)
CLEAN, PARTITION, HEALED, RESET, BLACKHOLE, AFTER = range(6)


@pytest.fixture(scope="module")
def net():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    n = netns.Namespaces().create()
    yield n
    n.destroy()


def read_json(path, default=None):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return default


class Ranks:
    """netfault_ranks.py in the ranks' namespace; phases set through DIR/phase."""

    def __init__(self, net, address, job, work):
        self.work = work
        self.log = open(work / "ranks.log", "w")
        self.proc = subprocess.Popen(
            [
                *net.prefix(net.ranks_ns),
                sys.executable,
                str(Path(__file__).parent / "netfault_ranks.py"),
                f"--collector={address}",
                f"--job={job}",
                f"--work={work}",
                f"--world={WORLD}",
                "--timeout=240",
            ],
            env={**os.environ, "PYTHONPATH": child_pythonpath()},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the launcher and its ranks: one process group (kill())
        )

    def progress(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"ranks exited {self.proc.returncode}: {self.output()}")
        return read_json(self.work / "progress.json", {"step": 0, "phase": 0, "phase_steps": 0})

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def output(self):
        return (self.work / "ranks.log").read_text()

    def run_phase(self, phase, steps=PHASE_STEPS, also=lambda: True, what=""):
        """Enters ``phase`` and waits until the ranks trained ``steps`` steps in it and ``also()``
        holds; returns the step count then."""
        (self.work / "phase").write_text(str(phase))

        def done():
            p = self.progress()
            return p["phase"] == phase and p["phase_steps"] >= steps and also() and p["step"]

        return wait_until(done, 120, f"{steps} steps in phase {phase} {what}")

    def finish(self):
        (self.work / "phase").write_text("-1")
        rc = self.proc.wait(180)
        self.log.close()
        assert rc == 0, self.output()
        return [read_json(self.work / f"rank{r}.json") for r in range(WORLD)]


# Long: one end-to-end scenario read top to bottom, its phases commented in order; split, its
# processes and expectations would be handed between helpers.
def test_partition_reset_and_blackhole_lose_nothing(net, tmp_path):
    # A step waits for both ranks' reports however far apart the two agents' reconnects land
    # after a fault (the join within --step_timeout is not what this test measures; a CI run
    # under load closed a step with one rank missing at the default 5 s).
    collector = Collector(
        tmp_path, prefix=net.prefix(net.coll_ns), host=net.coll_ip, step_timeout="120s"
    ).start()
    proxy = FaultProxy(net.ranks_gw, collector.host, collector.port).start()
    job = "netfault"
    work = tmp_path / "work"
    work.mkdir()
    ranks = Ranks(net, proxy.address, job, work)
    try:

        def stored():
            return collector.query("SELECT COUNT(*) FROM rank_steps WHERE job = ?", (job,))[0][0]

        # Clean: both agents connected through the proxy and acked.
        ranks.run_phase(CLEAN, also=lambda: stored() >= WORLD * 5, what="with reports stored")

        # Partition: the link down while the ranks train; the agents' connections stay open
        # (no FIN crosses), then heal and everything buffered arrives.
        net.partition()
        try:
            at_heal = ranks.run_phase(PARTITION, steps=PARTITION_STEPS)
            stored_during = stored()
        finally:
            net.heal()
        assert stored_during < WORLD * at_heal  # the partition held reports back
        ranks.run_phase(
            HEALED,
            also=lambda: stored() >= WORLD * at_heal,
            what="with every step of the partition stored",
        )

        # Reset: every connection RST mid-stream; the agents reconnect and resend.
        before = proxy.accepted
        assert proxy.reset_all() >= WORLD
        ranks.run_phase(
            RESET, also=lambda: proxy.accepted >= before + WORLD, what="with both reconnected"
        )

        # Blackhole: connections accepted, nothing answered; the agents' reconnects land in it.
        proxy.set_mode("blackhole")
        before = proxy.accepted
        proxy.reset_all()
        entered = ranks.run_phase(
            BLACKHOLE,
            also=lambda: proxy.accepted >= before + WORLD,
            what="with both agents' reconnects blackholed",
        )
        stored_in_blackhole = stored()
        proxy.set_mode("pass")
        proxy.reset_all()  # the blackholed connections end; the agents reconnect for real
        ranks.run_phase(
            AFTER, also=lambda: stored() >= WORLD * entered, what="with the blackhole's steps"
        )
        assert stored_in_blackhole < WORLD * entered
        results = ranks.finish()
    finally:
        ranks.kill()
        proxy.close()
        collector.stop()

    steps = results[0]["steps"]
    assert all(r["steps"] == steps for r in results)
    # Every step stored exactly once, from both ranks, joined.
    rows = collector.step_rows(job)
    assert sorted(rows) == list(range(steps))
    assert all(r["ranks"] == WORLD and r["missing_ranks"] == "" for r in rows.values())
    per_rank = collector.query(
        "SELECT rank, COUNT(*), COUNT(DISTINCT step) FROM rank_steps WHERE job = ? GROUP BY rank",
        (job,),
    )
    assert sorted(per_rank) == [(r, steps, steps) for r in range(WORLD)]
    for r in results:
        stats = r["stats"]
        assert stats["acked"] == steps and stats["dropped"] == 0, stats
        assert stats["reconnects"] >= 2, stats  # the reset and the blackhole at least

    # The ranks' step time under each fault, against the clean phase (reported, not asserted).
    names = ["clean", "partition", "healed", "reset", "blackhole", "after"]
    for r, res in enumerate(results):
        clean = statistics.median(res["times"][str(CLEAN)])
        ratios = {
            names[int(p)]: round(statistics.median(t) / clean, 3) for p, t in res["times"].items()
        }
        print(f"rank {r}: median step {clean * 1e3:.1f} ms clean; ratios {ratios}")
