"""Real DDP ranks (gloo, the real shim) training through network faults, for test_net_faults.py
and bench/net_faults.py. Run as a program inside the ranks' network namespace::

    python netfault_ranks.py --collector HOST:PORT --job J --work DIR [--world 2] [--attach JSON]

It starts --world processes of itself (--rank r), which join a gloo group on 127.0.0.1 and train
(the launcher itself imports no torch: on a loaded 2-core machine each import costs seconds).

Rank 0 reads the current phase (an integer) from DIR/phase each step and broadcasts it, so every
rank changes phase at the same step; a negative phase ends the run. Rank 0 writes
DIR/progress.json ({"step", "phase", "phase_steps"}) after every step; at the end each rank writes
DIR/rank{r}.json: the steps it trained, its step times (seconds) per phase, its warnings and
``mon.close()``'s statistics. The parent drives the faults between phases.
"""

import argparse
import json
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _phase_from_rank0(rank: int, work: Path) -> int:
    from shim_harness import value_from_rank0

    phase = 0
    if rank == 0:
        try:
            phase = int((work / "phase").read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            pass
    return value_from_rank0(phase)


def worker(rank, world_size, collector, job, work_dir, attach_kwargs):
    import rankscope.torch as rst
    from shim_harness import tiny_ddp, train_step, write_json

    work = Path(work_dir)
    ddp, sgd = tiny_ddp()
    times = {}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mon = rst.attach(ddp, collector=collector, job=job, **attach_kwargs)
        step, phase, phase_steps = 0, 0, 0
        while True:
            now = _phase_from_rank0(rank, work)
            if now < 0:
                break
            if now != phase:
                phase, phase_steps = now, 0
            t0 = time.perf_counter()
            train_step(ddp, sgd, mon, rank, step)
            times.setdefault(str(phase), []).append(time.perf_counter() - t0)
            step += 1
            phase_steps += 1
            if rank == 0:
                write_json(
                    work / "progress.json",
                    {"step": step, "phase": phase, "phase_steps": phase_steps},
                )
        caught = [str(m.message) for m in w if "rankscope" in str(m.message)]
        stats = mon.close(timeout=120)
    write_json(
        work / f"rank{rank}.json",
        {"steps": step, "times": times, "warnings": caught, "stats": stats},
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--collector", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--attach", default="{}", help="JSON of more rankscope.torch.attach arguments")
    p.add_argument("--rank", type=int, default=-1, help="(internal) run this rank")
    p.add_argument("--port", type=int, default=0, help="(internal) the gloo rendezvous port")
    a = p.parse_args()
    if a.rank >= 0:
        from shim_harness import run_rank

        kwargs = {"sketch_dim": 256, "warn_after": 0.5, "max_backoff": 0.5, **json.loads(a.attach)}
        run_rank(a.rank, worker, a.port, a.world, (a.collector, a.job, a.work, kwargs))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen([sys.executable, __file__, *sys.argv[1:], f"--rank={r}", f"--port={port}"])
        for r in range(a.world)
    ]
    deadline = time.monotonic() + a.timeout
    codes = [None] * a.world
    while None in codes:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            sys.exit(f"netfault_ranks: rank exit codes {codes} (or past --timeout {a.timeout} s)")
        time.sleep(0.1)


if __name__ == "__main__":
    main()
