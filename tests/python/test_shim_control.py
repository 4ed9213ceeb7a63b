"""Attach without restart, and a collector that dies: real DDP (4 gloo ranks), real collector,
real `rankscope ctl`.

- dormant -> `ctl enable` -> `ctl set --every 3 --sketch_dim 512` -> `ctl disable`: every rank
  applies each control at the same step, and the collector stores exactly the steps the settings
  say, each joined from all 4 ranks;
- the collector is SIGKILLed mid-training: training goes on at full speed and warns once; after
  a restart on the same port and database, every report arrives. The ranks are given the
  collector as one shard of a fleet (a list): each picks it and retries it, never the other.
"""

import json
import threading

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

from conftest import parse_metric, wait_until  # noqa: E402
import shim_harness  # noqa: E402

WORLD = 4


class Background:
    """shim_harness.spawn in a thread, so the test can act while the ranks train."""

    def __init__(self, fn, *args, timeout):
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(fn, args, timeout), daemon=True)
        self.thread.start()

    def _run(self, fn, args, timeout):
        try:
            shim_harness.spawn(fn, WORLD, *args, timeout=timeout)
        except BaseException as e:  # reported by join()
            self.error = e

    def alive(self):
        if self.error is not None:
            raise self.error
        return self.thread.is_alive()

    def join(self, timeout):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "DDP ranks did not finish"
        if self.error is not None:
            raise self.error


def read_json(path, default=None):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def settings_at(transitions, step):
    current = None
    for first, enabled, every, dim in transitions:
        if first <= step:
            current = (enabled, every, dim)
    return current


# Long: one end-to-end scenario read top to bottom, its phases commented in order; split, its
# processes and expectations would be handed between helpers.
def test_dormant_enable_retune_disable_through_ctl(collector, tmp_path):
    job = "ctl-job"
    work = tmp_path / "work"
    work.mkdir()
    run = Background(
        shim_harness.control_worker, collector.address, job, str(work), 150, timeout=200
    )

    def progress():
        run.alive()
        return (read_json(work / "progress.json") or {}).get("step", 0)

    def transitions(rank):
        return read_json(work / f"rank{rank}.json", [])

    def all_ranks(predicate, what, timeout=60):
        return wait_until(
            lambda: run.alive() and all(predicate(transitions(r)) for r in range(WORLD)),
            timeout,
            what,
        )

    # Dormant: the ranks connected (the job is known) but nothing is reported.
    wait_until(
        lambda: collector.query("SELECT 1 FROM jobs WHERE job = ?", (job,)),
        60,
        "the dormant job's hello",
    )
    wait_until(lambda: progress() >= 10, 60, "10 dormant steps")
    assert collector.step_rows(job) == {}
    # No control known yet (a dormant start states none): RankscopeJobStalled's guard is absent.
    assert parse_metric(collector.scrape(), "rankscope_reporting_enabled", train_job=job) is None

    out = collector.ctl("enable", job, "--lead_steps=5")
    assert "enabled=true" in out and f"{WORLD} ranks notified" in out, out
    assert parse_metric(collector.scrape(), "rankscope_reporting_enabled", train_job=job) == 1
    all_ranks(lambda t: t[-1][1], "every rank to apply enable")
    enabled_at = transitions(0)[-1][0]
    wait_until(lambda: len(collector.step_rows(job)) >= 8, 60, "8 enabled steps stored")

    out = collector.ctl("set", job, "--every=3", "--sketch_dim=512", "--lead_steps=5")
    assert "every=3" in out and "sketch_dim=512" in out, out
    all_ranks(lambda t: t[-1][2:] == [3, 512], "every rank to apply every=3, sketch_dim=512")
    retuned_at = transitions(0)[-1][0]
    wait_until(
        lambda: len([s for s in collector.step_rows(job) if s >= retuned_at]) >= 4,
        60,
        "4 steps stored with every=3, sketch_dim=512",
    )

    collector.ctl("disable", job, "--lead_steps=5")
    # Switched off on purpose: its steps stop, and RankscopeJobStalled must not fire.
    assert parse_metric(collector.scrape(), "rankscope_reporting_enabled", train_job=job) == 0
    all_ranks(lambda t: not t[-1][1], "every rank to apply disable")
    disabled_at = transitions(0)[-1][0]
    wait_until(lambda: progress() >= disabled_at + 10, 60, "10 disabled steps")
    (work / "stop").touch()
    run.join(60)

    # Every rank switched at the same steps.
    per_rank = [transitions(r) for r in range(WORLD)]
    assert all(t == per_rank[0] for t in per_rank), per_rank
    assert [t[1:] for t in per_rank[0]] == [
        [False, 1, 256],
        [True, 1, 256],
        [True, 3, 512],
        [False, 3, 512],
    ], per_rank[0]
    assert 10 <= enabled_at < retuned_at < disabled_at
    last = read_json(work / "rank0.stats.json")["last"]

    # The collector holds exactly the steps the settings select, each from all 4 ranks.
    expected = {
        s
        for s in range(last)
        if settings_at(per_rank[0], s)[0] and s % settings_at(per_rank[0], s)[1] == 0
    }
    rows = collector.step_rows(job)
    assert set(rows) == expected
    for step, r in rows.items():
        assert r["ranks"] == WORLD and r["missing_ranks"] == "", (step, r)
        assert r["grad_cosine_mean"] is not None and -1 <= r["grad_cosine_mean"] <= 1
    for rank in range(WORLD):
        stats = read_json(work / f"rank{rank}.stats.json")["stats"]
        assert stats["acked"] == len(expected) and stats["rejected"] == 0, stats
        assert stats["invalid"] == 0 and stats["dropped"] == 0, stats
        assert stats.get("shim_late_controls", 0) == 0, stats


def fleet_around(address: str, job: str) -> str:
    """A collector list (docs/deploy.md "A fleet of collectors") of `address` and a shard that
    never runs, in which `job` hashes to `address`."""
    import rankscope._native as native

    for port in range(1, 1024):
        fleet = f"127.0.0.1:{port}, {address}"
        if native.pick_collector(fleet, job) == address:
            return fleet
    raise AssertionError("no list found")


def test_collector_killed_mid_training(collector, tmp_path):
    job = "outage"
    work = tmp_path / "work"
    work.mkdir()
    # The ranks are given a fleet: they pick the job's shard, this collector, and retry it
    # through the outage, never the other shard (which never runs).
    fleet = fleet_around(collector.address, job)
    run = Background(shim_harness.outage_worker, fleet, job, str(work), 20, timeout=240)
    wait_until(
        lambda: run.alive() and len(collector.step_rows(job)) >= 5,
        90,
        "5 steps stored before the kill",
    )
    collector.kill()
    (work / "killed").touch()
    outage = wait_until(
        lambda: run.alive() and read_json(work / "outage_done.json"),
        120,
        "the ranks to train through the outage",
    )
    collector.restart()
    run.join(180)

    results = [read_json(work / f"rank{r}.json") for r in range(WORLD)]
    steps = results[0]["steps"]
    assert all(r["steps"] == steps for r in results)
    assert steps >= outage["step"] + 10

    # Training went on through the outage. (How long a step takes with the collector down is a
    # benchmark, not an assertion: bench/agent_bench's "collector down" rows, PERFORMANCE.md.)
    for r in results:
        during = r["times"]["B"]
        assert len(during) >= 20
        # One warning, once.
        assert sum("no connection" in w for w in r["warnings"]) == 1, r["warnings"]

    # Everything the buffers held arrived after the restart.
    rows = collector.step_rows(job)
    assert sorted(rows) == list(range(steps))
    assert all(r["ranks"] == WORLD and r["missing_ranks"] == "" for r in rows.values())
    assert len(collector.rank_rows(job)) == WORLD * steps
    for r in results:
        stats = r["stats"]
        assert stats["acked"] == steps and stats["dropped"] == 0, stats
        assert stats["reconnects"] >= 1, stats
        assert r["collector"] == collector.address


def test_controls_survive_collector_restarts(collector, tmp_path):
    """enable -> restart the collector -> disable -> restart -> `ctl set --every=2`: every control
    after a restart reaches the ranks, and the last one keeps the job disabled (a restarted
    collector continues from the control its agents state in their hello, not from defaults)."""
    job = "ctl-restart"
    work = tmp_path / "work"
    work.mkdir()
    run = Background(
        shim_harness.control_worker, collector.address, job, str(work), 150, timeout=200
    )

    def transitions(rank):
        return read_json(work / f"rank{rank}.json", [])

    def all_ranks(predicate, what, timeout=60):
        return wait_until(
            lambda: run.alive() and all(predicate(transitions(r)) for r in range(WORLD)),
            timeout,
            what,
        )

    def ctl_once_reconnected(verb, *flags):
        """`ctl` once every rank reconnected to the restarted collector (each within its
        backoff; a rank that reconnects after the agreed step would apply the control late, as
        docs/shim.md says; a control sent before any rank is back is refused, which
        tests/common/query_client_test.cc checks)."""
        wait_until(
            lambda: (
                run.alive()
                and collector.metric("rankscope_connected_agents", train_job=job) == WORLD
            ),
            60,
            "every rank to reconnect",
            interval=0.2,
        )
        return collector.ctl(verb, job, "--lead_steps=5", *flags)

    wait_until(
        lambda: collector.query("SELECT 1 FROM jobs WHERE job = ?", (job,)),
        60,
        "the dormant job's hello",
    )
    collector.ctl("enable", job, "--lead_steps=5")
    all_ranks(lambda t: t[-1][1], "every rank to apply enable")

    collector.stop()
    collector.restart()
    out = ctl_once_reconnected("disable")
    assert "enabled=false" in out, out
    all_ranks(lambda t: not t[-1][1], "every rank to apply disable after a collector restart")

    collector.stop()
    collector.restart()
    out = ctl_once_reconnected("set", "--every=2")
    assert "enabled=false" in out and "every=2" in out, out
    all_ranks(lambda t: t[-1][1:3] == [False, 2], "every rank to apply every=2, still disabled")
    (work / "stop").touch()
    run.join(60)
    per_rank = [transitions(r) for r in range(WORLD)]
    assert all(t == per_rank[0] for t in per_rank), per_rank
    assert [t[1:3] for t in per_rank[0]] == [[False, 1], [True, 1], [False, 1], [False, 2]]
