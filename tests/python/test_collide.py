"""Two live runs under one job name (issue 34, item 1), tried as a user would: two independent
2-rank DDP jobs (gloo on CPU, real processes) started at the same time with the same job name
and default ``attach`` arguments, against a real collector.

Promises checked (docs/reliability.md "Runs that collide"):
- whichever ranks connect first, one run holds the job and the other run's ranks are refused on
  every rank (ALREADY_EXISTS naming the holder): never a mix of the two runs' ranks in one step;
- every rank of the refused run is told: one line on its stderr, ``stats()["held_elsewhere"]``;
  the collector logs it once and counts it (``rankscope_reports_rejected_total{reason=
  "run_collision"}``);
- the holder's node then "dies" without a FIN (its processes are SIGSTOPped: the kernel keeps
  the TCP connection, nobody answers HTTP/2 pings): the collector's keepalive drops its streams,
  and the refused ranks, which kept retrying instead of giving up, are admitted as a restart;
  every report they recorded, those buffered while refused included, is then stored.

No timed assertion: every wait is for an observable state, with a generous deadline.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

import shim_harness  # noqa: E402
from conftest import Collector, free_port, wait_until  # noqa: E402

JOB = "collide-exp"
LOSS_OFFSET = 1000.0  # run i's losses are i * LOSS_OFFSET + (something in [0, 10)): who stored
HELD_LINE = "does NOT store job"


def _all_ranks(flag: bool) -> bool:
    """True iff ``flag`` holds on every rank of this run (a test-only collective)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _run_rank(rank, port, run, address, work_dir):
    """One rank of run ``run`` (0 or 1): trains until the collector has decided about every rank
    of its run (acked a report, or refused it), says so, then waits for the test's "go"; a refused
    run then trains on until the collector stores it (held_elsewhere cleared, all acked)."""
    work = Path(work_dir)
    err = open(work / f"run{run}.rank{rank}.stderr", "w")
    os.dup2(err.fileno(), 2)  # the agent's own lines (fprintf to fd 2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import rankscope.torch as rst
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = rst.attach(model, collector=address, job=JOB)  # default arguments otherwise

    def train_step():
        x = torch.randn(4, 8)
        # A constant offset changes no gradient; it names the run in the stored losses.
        loss = model(x).pow(2).mean() + run * LOSS_OFFSET
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss)

    deadline = time.monotonic() + 90
    while True:
        train_step()
        s = mon.stats()
        if _all_ranks(s["acked"] >= 1 or s["held_elsewhere"]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    s = mon.stats()
    shim_harness.write_json(
        work / f"run{run}.rank{rank}.decided.json",
        {
            "pid": os.getpid(),
            "held": s["held_elsewhere"],
            "acked": s["acked"],
            "run_id": mon.run_id,
        },
    )
    wait_until(lambda: (work / "go").exists(), 120, "the test's go")
    # Only the refused run gets here (the holder is stopped): train on until admitted, then wait
    # (recording nothing more) until the collector has acked every report of this rank.
    deadline = time.monotonic() + 90
    while True:
        train_step()
        if _all_ranks(not mon.stats()["held_elsewhere"]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    wait_until(
        lambda: (lambda s: s["acked"] == s["recorded"])(mon.stats()), 60, "every report acked"
    )
    final = mon.close(timeout=10)
    shim_harness.write_json(work / f"run{run}.rank{rank}.final.json", final)
    dist.destroy_process_group()


def _stored_run(loss: float) -> int:
    return int(loss // LOSS_OFFSET)


# Long: one end-to-end scenario read top to bottom, its phases commented in order; split, its
# processes and expectations would be handed between helpers.
def test_two_live_runs_under_one_name_collide_and_the_refused_run_is_told(tmp_path):
    # Keepalive short so that the "dead" holder is dropped quickly (default: 20 s + 10 s).
    collector = Collector(
        tmp_path, extra_args=["--grpc_keepalive_time=1s", "--grpc_keepalive_timeout=1s"]
    ).start()
    ctx = mp.get_context("spawn")
    runs = []
    try:
        for run in (0, 1):  # started together, as two users would
            port = free_port()
            runs.append(
                [
                    ctx.Process(
                        target=_run_rank, args=(rank, port, run, collector.address, str(tmp_path))
                    )
                    for rank in (0, 1)
                ]
            )
        for procs in runs:
            for p in procs:
                p.start()

        def decided():
            files = [tmp_path / f"run{r}.rank{k}.decided.json" for r in (0, 1) for k in (0, 1)]
            return all(f.exists() for f in files) and {
                (r, k): json.loads((tmp_path / f"run{r}.rank{k}.decided.json").read_text())
                for r in (0, 1)
                for k in (0, 1)
            }

        d = wait_until(decided, 300, "both runs to start and learn the collector's decision")
        assert d[(0, 0)]["run_id"] == d[(0, 1)]["run_id"] != d[(1, 0)]["run_id"]
        assert d[(1, 0)]["run_id"] == d[(1, 1)]["run_id"] != ""
        held = {run: [d[(run, k)]["held"] for k in (0, 1)] for run in (0, 1)}
        # One run holds the job on both ranks; the other is refused on both: never a mix.
        assert sorted(map(tuple, held.values())) == [(False, False), (True, True)], held
        loser = 0 if held[0][0] else 1
        winner = 1 - loser
        assert all(d[(winner, k)]["acked"] >= 1 for k in (0, 1)), d
        assert all(d[(loser, k)]["acked"] == 0 for k in (0, 1)), d

        # Every refused rank was told once on stderr; the holder's ranks were told nothing.
        for run in (0, 1):
            for k in (0, 1):
                text = (tmp_path / f"run{run}.rank{k}.stderr").read_text()
                assert text.count(HELD_LINE) == (1 if run == loser else 0), (run, k, text)
                if run == loser:
                    assert d[(winner, 0)]["run_id"] in text  # the holder is named
        # The collector counted every refusal and logged the colliding run once.
        assert collector.metric("rankscope_reports_rejected_total", reason="run_collision") >= 2
        assert collector.log().count("held by another live run") == 1, collector.log()

        # Nothing of the refused run is stored while the holder lives; no step mixes the runs.
        rows = collector.rank_rows(JOB)
        assert rows and {_stored_run(r[2]) for r in rows} == {winner}

        # The holder's node "dies" without a FIN; its streams are found dead by keepalive.
        for k in (0, 1):
            os.kill(d[(winner, k)]["pid"], signal.SIGSTOP)
        (tmp_path / "go").write_text("")
        for p in runs[loser]:
            p.join(150)
            assert p.exitcode == 0
        for k in (0, 1):
            final = json.loads((tmp_path / f"run{loser}.rank{k}.final.json").read_text())
            assert not final["held_elsewhere"] and not final["refused"], final
            assert final["dropped"] == 0 and final["rejected"] == 0, final
            assert final["acked"] == final["recorded"] > d[(loser, k)]["acked"], final
        # Admitted as a restart: every step it recorded is stored as its own, both ranks from
        # one run in each step.
        rows = collector.rank_rows(JOB)
        by_step = {}
        for step, rank, loss, _, _ in rows:
            by_step.setdefault(step, {})[rank] = _stored_run(loss)
        assert all(len(set(r.values())) == 1 for r in by_step.values()), by_step
        loser_steps = {s for s, r in by_step.items() if r == {0: loser, 1: loser}}
        final0 = json.loads((tmp_path / f"run{loser}.rank0.final.json").read_text())
        assert len(loser_steps) == final0["recorded"], (final0, sorted(loser_steps))
    finally:
        for procs in runs:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        collector.stop()
