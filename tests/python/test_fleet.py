"""A fleet of collectors sharded by job (issue 35, items 2 and 3): three real collectors on
loopback and 31 loadgen jobs (each rank a real rankscope::Agent given the whole list, with a
duplicate). Every job's ranks meet on the shard rendezvous hashing names; one shard is SIGKILLed
and restarted on its port and database. (The real shim's path through a list, with its collector
killed and restarted, is test_shim_control.py::test_collector_killed_mid_training.)

- only the victim's jobs pause: their agents buffer, reconnect and resend, and every step of
  every job is stored exactly once, on its shard and nowhere else;
- the other shards' jobs never notice: their agents never reconnect nor resend, and their shards
  keep storing while the victim is down;
- a job whose buffers are smaller than the outage says so: its drops are counted by its agents
  and exported by its (restarted) shard, as with a lone collector;
- `rankscope jobs --collector=LIST` lists every shard's jobs, each with its collector, and so
  does every shard's web view (--fleet=LIST); a job's view names its shard.

Every wait polls an observable condition against a generous deadline that only fails the test.
"""

import json
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import BUILD_DIR, Collector, free_port, wait_until
from test_faults import DEADLINE, Loadgen

_native = pytest.importorskip("rankscope._native", reason="build the trainer shim")

CLI_BIN = BUILD_DIR / "bin" / "rankscope"
JOBS, RANKS, STEPS = 30, 2, 400  # 8 s of steps at 20 ms: the outage falls inside


def http_get(c: Collector, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{c.http_port}{path}", timeout=10) as r:
        return r.read().decode()


def rows_by_job(c: Collector) -> dict:
    return dict(c.query("SELECT job, COUNT(*) FROM rank_steps GROUP BY job"))


def ranks_by_job(c: Collector) -> dict:
    return dict(c.query("SELECT job, COUNT(DISTINCT rank) FROM rank_steps GROUP BY job"))


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
        p.kill()
    for c in shards:
        if c.proc is not None:
            c.kill()


# Long: one end-to-end scenario read top to bottom, its phases commented in order; split, its
# processes and expectations would be handed between helpers.
def test_one_shard_killed_only_its_jobs_pause_and_nothing_is_lost(tmp_path, fleet):
    shards, started = fleet
    for c in shards:
        c.port = free_port()
    # Duplicates count once (docs/deploy.md): the list as agents, the CLI and the collectors'
    # web views (--fleet) are given it.
    addresses = [c.address for c in shards]
    collector_list = ",".join(addresses + [addresses[0]])
    for c in shards:
        c.extra_args.append(f"--fleet={collector_list}")
        c.start()
    by_address = {c.address: c for c in shards}
    jobs = [f"fleet-{i}" for i in range(JOBS)]
    # The victim: the shard of a job with small buffers, which the outage outlasts.
    tiny_job = "fleet-tiny"
    victim = by_address[_native.pick_collector(collector_list, tiny_job)]
    survivors = [c for c in shards if c is not victim]
    shard_of = {j: _native.pick_collector(collector_list, j) for j in jobs + [tiny_job]}
    victim_jobs = [j for j in jobs if shard_of[j] == victim.address]
    # 30 jobs over 3 shards leave none on one with probability ~3 (2/3)^30 = 1.5e-5.
    assert victim_jobs and len(victim_jobs) < JOBS, shard_of

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

    def every_rank_stored():
        ranks = {c.address: ranks_by_job(c) for c in shards}
        return all(ranks[a].get(j, 0) == RANKS for j, a in shard_of.items())

    # Every rank of every job stores on its shard before the kill.
    wait_until(every_rank_stored, DEADLINE, "every rank of every job storing on its shard")
    assert not main.recording_done(), "the jobs ended before the kill: raise STEPS"
    victim.kill()
    at_kill = {c.address: sum(rows_by_job(c).values()) for c in survivors}
    # The outage: the tiny job drops, the other shards keep storing their jobs.
    wait_until(lambda: tiny.progress()["dropped"] > 0, DEADLINE, "the tiny job to drop")
    wait_until(
        lambda: all(sum(rows_by_job(c).values()) > at_kill[c.address] for c in survivors),
        DEADLINE,
        "the other shards to store while the victim is down",
    )
    victim.restart()

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

    # The CLI fans out: every job, each with its shard.
    cli = subprocess.run(
        [str(CLI_BIN), f"--collector={collector_list}", "jobs"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert cli.returncode == 0, cli.stderr
    listed = {ln.split()[0]: ln.split()[-1] for ln in cli.stdout.splitlines()[1:]}
    assert listed == shard_of, cli.stdout
    # So do the web views: every shard lists every job with its shard, and names the shard of a
    # job it does not hold.
    for c in shards:
        web = json.loads(http_get(c, "/api/v1/jobs"))
        assert {j["key"]: j["collector"] for j in web["jobs"]} == shard_of, web
        assert all(j["remote"] == (j["collector"] != c.address) for j in web["jobs"]), web
        assert "unreachable" not in web
        elsewhere = next(j for j, a in shard_of.items() if a != c.address)
        with pytest.raises(urllib.error.HTTPError) as e:
            http_get(c, f"/api/v1/jobs/{elsewhere}/steps")
        assert e.value.code == 404
        assert f"job {elsewhere} is on {shard_of[elsewhere]}" in e.value.read().decode()

    for c in shards:
        assert c.stop() == 0
    stored = {c.address: rows_by_job(c) for c in shards}

    # Every job on exactly one shard: the one its agents picked, as the CLI and Python pick it.
    for a in summary["agents"] + tiny_summary["agents"]:
        assert a["collector"] == shard_of[a["job"]], a
    for job, address in shard_of.items():
        assert [x for x in addresses if job in stored[x]] == [address], job

    # Every step of every job stored once; only the victim's agents noticed the outage.
    assert summary["flushed"] and summary["total"]["dropped"] == 0, summary["total"]
    for a in summary["agents"]:
        assert a["recorded"] == STEPS and a["acked"] == STEPS and a["rejected"] == 0, a
        if a["collector"] == victim.address:
            assert a["reconnects"] >= 1, a
        else:
            assert a["reconnects"] == 0 and a["sent"] == a["recorded"], a
    for job in jobs:
        c = by_address[shard_of[job]]
        assert stored[c.address][job] == RANKS * STEPS, job
        assert sorted(c.step_rows(job)) == list(range(1, STEPS + 1)), job
    # The tiny job: what its buffers held is stored once, what they could not is counted.
    assert tiny_dropped > 0
    assert stored[victim.address][tiny_job] == RANKS * STEPS - tiny_dropped
    for a in tiny_summary["agents"]:
        assert a["acked"] == a["recorded"] - a["dropped"] and a["recorded"] == STEPS, a
    dup = victim.query(
        "SELECT step, rank FROM rank_steps WHERE job = ? GROUP BY step, rank HAVING COUNT(*) > 1",
        (tiny_job,),
    )
    assert dup == []
    print(
        f"\nfleet: {len(shard_of)} jobs on 3 shards, the victim {victim.address} held "
        f"{len(victim_jobs)} + the tiny job; the tiny job dropped {tiny_dropped} of "
        f"{RANKS * STEPS}, every other job stored all {RANKS * STEPS}"
    )
