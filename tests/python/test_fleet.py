"""A fleet of collectors sharded by job (issue 35, items 2 and 3): three real collectors on
loopback, 31 loadgen jobs (each rank a real rankscope::Agent given the whole list) and one real
DDP job (2 gloo ranks through rankscope.torch, given the same list). Every job's ranks meet on
the shard rendezvous hashing names; one shard is SIGKILLed and restarted on its port and database.

- only the victim's jobs pause: their agents buffer, reconnect and resend, and every step of
  every job is stored exactly once, on its shard and nowhere else;
- the other shards' jobs never notice: their agents never reconnect nor resend, and their shards
  keep storing while the victim is down;
- a job whose buffers are smaller than the outage says so: its drops are counted by its agents
  and exported by its (restarted) shard, as with a lone collector;
- `rankscope jobs --collector=LIST` lists every shard's jobs, each with its collector.

Every wait polls an observable condition against a generous deadline that only fails the test.
"""

import json
import subprocess
import threading

import pytest

from conftest import BUILD_DIR, Collector, wait_until
from test_faults import DEADLINE, Loadgen

_native = pytest.importorskip("rankscope._native", reason="build the trainer shim")
shim_harness = pytest.importorskip("shim_harness")

CLI_BIN = BUILD_DIR / "bin" / "rankscope"
JOBS, RANKS, STEPS = 30, 2, 400
DDP_JOB, DDP_WORLD = "fleet-ddp", 2


class DdpJob:
    """shim_harness.outage_worker on DDP_WORLD ranks, in a thread, so the test acts meanwhile."""

    def __init__(self, collector: str, work_dir):
        self.error = None
        self.thread = threading.Thread(
            target=self._run, args=(collector, str(work_dir)), daemon=True
        )
        self.thread.start()

    def _run(self, collector, work_dir):
        try:
            shim_harness.spawn(
                shim_harness.outage_worker,
                DDP_WORLD,
                collector,
                DDP_JOB,
                work_dir,
                20,
                timeout=240,
            )
        except BaseException as e:  # reported by alive() and join()
            self.error = e

    def alive(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.thread.is_alive()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "DDP ranks did not finish"
        if self.error is not None:
            raise self.error


def read_json(path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def rows_by_job(c: Collector) -> dict:
    return dict(c.query("SELECT job, COUNT(*) FROM rank_steps GROUP BY job"))


@pytest.fixture
def fleet(tmp_path):
    shards = []
    for i in range(3):
        d = tmp_path / f"shard{i}"
        d.mkdir()
        shards.append(Collector(d, step_timeout="2s"))
    started = []
    yield shards, started
    for p in started:
        if isinstance(p, Loadgen):
            p.kill()
    for c in shards:
        if c.proc is not None:
            c.kill()


def test_one_shard_killed_only_its_jobs_pause_and_nothing_is_lost(tmp_path, fleet):
    shards, started = fleet
    for c in shards:
        c.start()
    # Duplicates count once (docs/deploy.md): the list as agents and the CLI are given it.
    addresses = [c.address for c in shards]
    collector_list = ",".join(addresses + [addresses[0]])
    by_address = {c.address: c for c in shards}
    victim = by_address[_native.pick_collector(collector_list, DDP_JOB)]
    survivors = [c for c in shards if c is not victim]
    # A job with small buffers on the victim: the outage outlasts them.
    tiny_job = next(
        j
        for j in (f"fleet-tiny-{i}" for i in range(64))
        if _native.pick_collector(collector_list, j) == victim.address
    )

    work = tmp_path / "ddp"
    work.mkdir()
    ddp = DdpJob(collector_list, work)
    # The loadgen jobs start once the DDP ranks report (their start-up takes seconds), so that
    # they run through the outage.
    wait_until(
        lambda: ddp.alive() and len(victim.step_rows(DDP_JOB)) >= 1,
        DEADLINE * 2,
        "the DDP job's first step on its shard",
    )
    main = Loadgen(
        tmp_path,
        collector_list,
        "fleet",
        ranks=RANKS,
        steps=STEPS,
        jobs=JOBS,
        sketch_dim=64,
        step_interval="20ms",
    )
    started.append(main)
    tiny = Loadgen(
        tmp_path,
        collector_list,
        tiny_job,
        ranks=RANKS,
        steps=STEPS,
        name="tiny",
        sketch_dim=64,
        step_interval="20ms",
        queue_capacity=16,
    )
    started.append(tiny)
    expected_shard = {
        j: by_address[_native.pick_collector(collector_list, j)]
        for j in [f"fleet-{i}" for i in range(JOBS)] + [tiny_job]
    }

    def every_rank_stored():
        ranks = {
            c.address: dict(
                c.query("SELECT job, COUNT(DISTINCT rank) FROM rank_steps GROUP BY job")
            )
            for c in shards
        }
        return all(ranks[c.address].get(j, 0) == RANKS for j, c in expected_shard.items())

    # Every rank of every job stores on its shard before the kill.
    wait_until(
        lambda: ddp.alive() and every_rank_stored() and len(victim.step_rows(DDP_JOB)) >= 5,
        DEADLINE,
        "every rank of every job storing on its shard",
    )
    victim.kill()
    (work / "killed").touch()
    at_kill = {c.address: sum(rows_by_job(c).values()) for c in survivors}

    # The outage: the DDP ranks train through it (and warn), the tiny job drops, the other
    # shards keep storing their jobs.
    wait_until(
        lambda: ddp.alive() and read_json(work / "outage_done.json"),
        DEADLINE * 2,
        "the DDP ranks to train through the outage",
    )
    wait_until(lambda: tiny.progress()["dropped"] > 0, DEADLINE, "the tiny job to drop")
    wait_until(
        lambda: all(sum(rows_by_job(c).values()) > at_kill[c.address] for c in survivors),
        DEADLINE,
        "the other shards to store while the victim is down",
    )
    victim.restart()

    ddp.join(240)
    summary = main.wait()
    tiny_summary = tiny.wait()
    tiny_dropped = tiny_summary["total"]["dropped"]
    wait_until(
        lambda: (
            victim.metric("rankscope_agent_dropped_reports_total", train_job=tiny_job)
            == tiny_dropped
        ),
        DEADLINE,
        "the tiny job's drop count in the restarted shard's /metrics",
    )

    # The CLI fans out: every job, each with its shard (and "jobs" fails on no shard).
    cli = subprocess.run(
        [str(CLI_BIN), f"--collector={collector_list}", "jobs"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert cli.returncode == 0, cli.stderr
    listed = {ln.split()[0]: ln.split()[-1] for ln in cli.stdout.splitlines()[1:]}

    for c in shards:
        assert c.stop() == 0
    stored = {c.address: rows_by_job(c) for c in shards}

    # Every job on exactly one shard, the one its agents and the CLI picked.
    agents = summary["agents"] + tiny_summary["agents"]
    shard_of = {}
    for a in agents:
        assert shard_of.setdefault(a["job"], a["collector"]) == a["collector"], a
    shard_of[DDP_JOB] = victim.address
    assert len(shard_of) == JOBS + 2
    for job, address in shard_of.items():
        assert address == _native.pick_collector(collector_list, job)
        assert listed[job] == address, (job, cli.stdout)
        for other in addresses:
            if other != address:
                assert job not in stored[other], (job, other)
    victim_jobs = [j for j, a in shard_of.items() if a == victim.address and j.startswith("fleet-")]
    assert any(j[len("fleet-") :].isdigit() for j in victim_jobs), "no loadgen job on the victim"

    # Every step of every job stored once; only the victim's agents noticed the outage.
    assert summary["flushed"] and summary["total"]["dropped"] == 0, summary["total"]
    for a in summary["agents"]:
        assert a["recorded"] == STEPS and a["acked"] == STEPS and a["rejected"] == 0, a
        if a["collector"] == victim.address:
            assert a["reconnects"] >= 1, a
        else:
            assert a["reconnects"] == 0 and a["sent"] == a["recorded"], a
    for job, address in shard_of.items():
        c = by_address[address]
        if job == DDP_JOB:
            continue
        dup = c.query(
            "SELECT step, rank FROM rank_steps WHERE job = ? GROUP BY step, rank "
            "HAVING COUNT(*) > 1",
            (job,),
        )
        assert dup == []
        if job != tiny_job:
            assert stored[address][job] == RANKS * STEPS, job
            assert sorted(c.step_rows(job)) == list(range(1, STEPS + 1)), job
    assert tiny_dropped > 0
    assert stored[victim.address][tiny_job] == RANKS * STEPS - tiny_dropped
    for a in tiny_summary["agents"]:
        assert a["acked"] == a["recorded"] - a["dropped"], a

    # The real shim's ranks: every step stored once on their shard after the outage.
    results = [read_json(work / f"rank{r}.json") for r in range(DDP_WORLD)]
    steps = results[0]["steps"]
    assert sorted(victim.step_rows(DDP_JOB)) == list(range(steps))
    assert len(victim.rank_rows(DDP_JOB)) == DDP_WORLD * steps
    for r in results:
        assert r["stats"]["acked"] == steps and r["stats"]["dropped"] == 0, r["stats"]
        assert r["stats"]["reconnects"] >= 1, r["stats"]
    print(
        f"\nfleet: {len(shard_of)} jobs on 3 shards, victim {victim.address} held "
        f"{len(victim_jobs) + 1} (DDP {steps} steps), tiny job dropped {tiny_dropped} of "
        f"{RANKS * STEPS}, others stored all {RANKS * STEPS} each"
    )
