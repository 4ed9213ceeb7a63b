"""Load: 2,000 concurrent agent streams on one collector, and the --max_streams limit.

test_2000_streams runs bench/stream_load.py's measurement once (N = 2,000 ranks of one job, each
a real agent with its own TCP connection in one rankscope-loadgen process, one report per rank
per second for 8 s) and asserts what must hold, not how fast:

- all 2,000 streams are open at once (rankscope_streams_open == 2000 while they are held);
- every report recorded is acked and stored (rank_steps rows == reports recorded);
- the collector's resident memory stays under a bound.

The bound. Measured on the 2-CPU development machine (docs/PERFORMANCE.md "Concurrent
streams"): idle 18 MiB, 42-44 KiB per stream once connected, 62-66 KiB per stream at the peak
with reports flowing (k = 1024), i.e. about 139 MiB at 2,000 streams after 20 s and 146 MiB at
most over 80 s (it stops growing after ~25 s). The test allows
idle + 2,000 x 160 KiB (about 2.5 times the measured per-stream peak; about 330 MiB): far above
allocator and gRPC-version noise, and far below what a leak or a per-stream buffer that grows
with the run (e.g. unbounded outbound queues: 4 KiB a report) would reach. It is a memory bound,
not a timed assertion: waits poll conditions against generous deadlines.
"""

import resource
import sys

import pytest

from conftest import BUILD_DIR, REPO, Collector, wait_until

sys.path.insert(0, str(REPO / "bench"))
import stream_load  # noqa: E402

STREAMS = 2000
KIB_PER_STREAM_BOUND = 160


def test_2000_streams_connect_store_everything_and_stay_under_the_memory_bound():
    for name in ("rankscope-collector", "rankscope-loadgen"):
        if not (BUILD_DIR / "bin" / name).exists():
            pytest.skip(f"{name} not built")
    # The collector and the loadgen each raise their soft limit up to the hard one.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < STREAMS + 300:
        pytest.skip(f"the hard file descriptor limit ({hard}) is below {STREAMS} streams")
    f = stream_load.run_streams(
        BUILD_DIR, STREAMS, duration=8, step_interval=1.0, sketch_dim=1024, hold=2.0
    )
    print(f)
    assert f["streams_open"] == STREAMS
    assert f["acked"] == f["recorded"] > 0
    assert f["rows"] == f["recorded"]
    bound_kib = f["idle_kib"] + STREAMS * KIB_PER_STREAM_BOUND
    assert f["peak_kib"] < bound_kib, (
        f"collector RSS peaked at {f['peak_kib'] / 1024:.0f} MiB with {STREAMS} streams, above "
        f"the bound {bound_kib / 1024:.0f} MiB ({f['kib_per_stream_peak']:.0f} KiB per stream)"
    )


_native = pytest.importorskip("rankscope._native")


def test_stream_beyond_max_streams_is_refused_and_the_others_keep_working(tmp_path):
    limit = 4
    c = Collector(tmp_path, extra_args=[f"--max_streams={limit}"]).start()
    dim = 16
    sketch = _native.Sketch(dim)

    def agent(rank):
        return _native.Agent(
            collector=c.address,
            job="limited",
            rank=rank,
            world_size=limit + 1,
            sketch_dim=dim,
            initial_backoff_s=0.05,
            max_backoff_s=0.5,
        )

    try:
        agents = [agent(r) for r in range(limit)]
        wait_until(
            lambda: all(a.stats()["connected"] for a in agents), 60, f"{limit} agents to connect"
        )
        extra = agent(limit)
        err = wait_until(lambda: extra.stats()["last_error"], 60, "the extra stream's refusal")
        assert err.startswith("RESOURCE_EXHAUSTED"), err
        assert "--max_streams" in err, err
        # The others keep working while the extra agent keeps being refused (and buffering).
        for step in range(1, 6):
            for a in agents + [extra]:
                assert a.record_sketch(step, 1.0, 1.0, sketch) == ""
        for a in agents:
            assert a.flush(60) == ""
        s = extra.stats()
        # (Not `connected`: it is true from the moment a retry's hello is written until the
        # refusal arrives, so a snapshot may catch it mid-retry.)
        assert s["recorded"] == 5 and s["acked"] == 0 and s["reconnects"] >= 1, s
        assert c.query(
            "SELECT COUNT(*) FROM rank_steps WHERE job = 'limited' AND rank < ?", (limit,)
        ) == [(limit * 5,)]
        assert c.query("SELECT COUNT(*) FROM rank_steps WHERE rank = ?", (limit,)) == [(0,)]
        # Once a slot frees, the refused agent gets in and delivers what it buffered.
        agents.pop().close(1)
        assert extra.flush(60) == ""
        extra.close(1)
        for a in agents:
            a.close(1)
    finally:
        c.stop()
