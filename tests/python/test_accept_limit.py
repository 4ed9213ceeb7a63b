"""The collector when gRPC's listener fails (issue 35 item 4: a reconnect storm of 16,384 agents
hit the file-descriptor limit): gRPC 1.51 stops accepting for good after one accept4 error, so
the collector must not serve on deaf to new connections. It shuts down cleanly and exits 75
(EX_TEMPFAIL) for its supervisor to restart it (collector/main.cc, LogGrpc)."""

import socket

from conftest import Collector

FD_LIMIT = 128  # the collector's hard and soft limit here: enough to start, not for the burst


def test_a_failed_accept_shuts_the_collector_down_for_a_restart(tmp_path):
    c = Collector(tmp_path, prefix=["prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", "--"]).start()
    socks = []
    try:
        # More connections than descriptors: one of the collector's accept4 calls fails EMFILE.
        for _ in range(2 * FD_LIMIT):
            if c.proc.poll() is not None:
                break
            try:
                socks.append(socket.create_connection(("127.0.0.1", c.port), timeout=10))
            except OSError:
                break  # the listener is closed: the collector is going down
        rc = c.proc.wait(timeout=60)
        log = c.log()
    finally:
        for s in socks:
            s.close()
        c.proc = None
        c._log.close()
    assert "Failed accept4" in log, log
    assert "stopped accepting connections" in log, log
    assert "stopped cleanly" in log, log  # open steps closed and committed, as on SIGTERM
    assert rc == 75, log
