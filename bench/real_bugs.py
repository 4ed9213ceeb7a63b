#!/usr/bin/env python3
"""Real silent data-parallel bugs, reproduced small and watched by rankscope (issue 36, item 3).

    PYTHONPATH=build/python .venv/bin/python bench/real_bugs.py --build-dir build

Each case reproduces, on the CPU with gloo, the mechanism of a bug reported upstream (see CASES:
the reference and one line on the mechanism). Every case is its own 4-rank DDP job (the real shim
`rankscope.torch`), all cases at once against one real `rankscope-collector` scraped by one real
`prometheus` that loads the project's alert rules unchanged (deploy/prometheus/rules/*.yml, with
deploy/prometheus.yml's scrape job at a 1 s scrape and evaluation interval, as
tests/python/test_prometheus_e2e.py runs it). The model and data are bench/detection.py's (a small
tanh MLP on a synthetic teacher task, SGD with momentum); the training is paced (a sleep after the
optimizer step, outside the step time the shim measures) so that the fault lasts long enough for
the rules' `for: 2m` and 24 ranks share a 2-core machine.

Ground truth, per case: the faulty rank(s) and the onset step, fixed by the case; and what the bug
really did, measured outside rankscope (a test-only all_gather of the parameters after the run:
which ranks' weights differ from the majority's; for the hang, which ranks never finished).

Scored, per case, from what rankscope stored and exported:
- named: the first step at or after the onset at which a faulty rank appears in any of the
  collector's per-step verdicts (step_stats: outlier_ranks, replica_divergent_ranks,
  drifting_ranks, slow_ranks, missing_ranks, and the aggregation integrity check: the rank its
  regression named, or every rank when it names none, since every rank received the wrong sum),
  which column, and how many steps after the onset; a job that stops stepping is named (as a
  job, no rank) when RankscopeJobStalled fired, its `stall_seconds` set to --stall-seconds for
  these jobs by a rule file of the benchmark's own;
- wrong: every other rank flagged at or after the onset, and anything flagged before it;
- the last step the collector stored (a job that stops reporting is visible only as that);
- alerts: every alert of the job that Prometheus' /api/v1/alerts showed pending or firing
  (polled every 2 s), with the seconds from the onset to the first time it was seen firing.

A case whose truth is "every rank" (a fault no replica can disagree about) counts as named only
if a flag names all ranks; the cross-rank signals cannot, by construction (docs/PERFORMANCE.md,
"Real bugs, reproduced", says why for each).
"""

# One file, several parts (the cases, the training ranks, the collector and Prometheus, the
# scoring, the driver: the sections below), kept together on purpose: one script run by hand and
# read with its results in docs/PERFORMANCE.md; what it shares with bench/detection.py (the model,
# the data, the collector's start-up, the rank lists and flag judging) it imports.

import argparse
import datetime
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import detection  # noqa: E402  (the model, the data, the ground-truth all_gather)

WORLD = 4
FAULTY = 2  # the faulty rank of the one-rank cases (the clipping case: rank 0, see CASES)

# name -> the upstream reference, the mechanism, and who is faulty ("all" or a rank).
CASES = {
    "moved_after_wrap": {
        "ref": "pytorch/pytorch#104336 (also Lightning-AI/pytorch-lightning#17937, "
        "pytorch/pytorch#12603)",
        "mechanism": "the DDP model is moved/cast after it was wrapped (here a float64 round "
        "trip at the onset, on every rank: the same Module._apply path as .cpu()/.cuda()); "
        "each parameter gets a new gradient accumulator, DDP's autograd hooks stay on the old "
        "ones, so no bucket is ever reduced again and every rank trains alone",
        "faulty": "all",
    },
    "raw_module_forward": {
        "ref": "k2-fsa/icefall#226, OpenTSLM/OpenTSLM#49, intel/e2eAIOK#197",
        "mechanism": "on some steps (the onset, then every 10th) one rank runs forward through "
        "ddp.module instead of the DDP wrapper: its reducer is not prepared, its backward "
        "reduces nothing and updates with its local gradient; its next all-reduce then pairs "
        "with the other ranks' previous one (one step out of phase from then on)",
        "faulty": FAULTY,
    },
    "clip_one_rank": {
        "ref": "the shape of deepspeedai/DeepSpeed#1801 (see #1839): ranks that apply different "
        "clipping",
        "mechanism": "gradient clipping runs on one rank only (here under `if rank == 0:`, "
        "beside logging the norm), after the all-reduce: the reduced gradients are identical, "
        "the update on rank 0 is not, and its weights drift from the others'",
        "faulty": 0,
    },
    "corrupt_one_rank": {
        "ref": "pytorch/pytorch#84803 (also #13803, #70048): a GPU-to-GPU copy that returns zeros",
        "mechanism": "after the all-reduce, the last eighth of the reduced bucket reads as "
        "zeros on one rank (a faulty copy path on its host), on every step from the onset",
        "faulty": FAULTY,
    },
    "corrupt_all_ranks": {
        "ref": "pytorch/pytorch#84803 and #96600's class, inside the reduction",
        "mechanism": "the same corruption on every rank (the reduction hands every rank the "
        "same wrong sum): the replicas stay identical",
        "faulty": "all",
    },
    "skipped_collective": {
        "ref": "pytorch/pytorch#33148 and #38174 (uneven inputs; the reason for DDP's join())",
        "mechanism": "one rank's data runs out one step before the others': it leaves the loop "
        "at the onset and waits in its end-of-training barrier, while the other ranks wait in "
        "the onset step's gradient all-reduce; nothing ever completes (a hang)",
        "faulty": FAULTY,
    },
}

RAW_FORWARD_EVERY = 10
EXIT_GRACE_S = 20.0
CORRUPT_FRACTION = 8  # the last 1/8 of the bucket reads as zeros
CLIP_MAX_NORM = 0.05  # binds on every step here (the ground truth counts the steps it bound)


def faulty_ranks(case: str) -> frozenset:
    f = CASES[case]["faulty"]
    return frozenset(range(WORLD)) if f == "all" else frozenset((f,))


# ---- the training ranks --------------------------------------------------------------------------


class _CorruptState:
    def __init__(self, pg, on_this_rank):
        self.pg = pg
        self.on_this_rank = on_this_rank
        self.armed = False


def _corrupt_hook(state, bucket):
    """DDP's all-reduce, then (when armed on this rank) the last 1/8 of the reduced bucket reads
    as zeros, as a copy that lost its data would leave it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    fut = default_hooks.allreduce_hook(state.pg, bucket)

    def corrupt(f):
        t = f.value()
        if state.armed and state.on_this_rank:
            flat = t.view(-1)
            flat[flat.numel() - flat.numel() // CORRUPT_FRACTION :].zero_()
        return t

    return fut.then(corrupt)


def _worker(rank, port, case, opts, collector, out_dir):
    """One gloo rank of one case's job: trains `opts["steps"]` steps with the case's bug from
    its onset on, then (unless hung) writes the ground truth to <out_dir>/<case>-rank<r>.json;
    an exception's traceback goes to <case>-rank<r>.error."""
    try:
        _train(rank, port, case, opts, collector, out_dir)
    except BaseException:
        import traceback

        (Path(out_dir) / f"{case}-rank{rank}.error").write_text(traceback.format_exc())
        raise


# Long: one measured run as it happens (set-up, the loop, what it records), its phases commented in
# order; split, its processes and figures would be handed between helpers.
def _train(rank, port, case, opts, collector, out_dir):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    import rankscope.torch as rst

    torch.set_num_threads(1)  # 24 ranks share the machine
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=opts["pg_timeout"]),
    )
    out = Path(out_dir)
    steps, onset, bsz = opts["steps"], opts["onset"], opts["batch_size"]
    mine = rank in faulty_ranks(case)
    ddp = nn.parallel.DistributedDataParallel(detection._model(opts["model_seed"]))
    sgd = torch.optim.SGD(ddp.parameters(), lr=opts["lr"], momentum=opts["momentum"])
    extra, corrupt = {}, None
    if case in ("corrupt_one_rank", "corrupt_all_ranks"):
        corrupt = _CorruptState(ddp.process_group, mine)
        extra = {"comm_hook": _corrupt_hook, "comm_hook_state": corrupt}
    mon = rst.attach(
        ddp,
        collector=collector,
        job=opts["jobs"][case],
        sketch_dim=opts["sketch_dim"],
        local_batch_size=bsz,
        param_check_every=opts["param_check_every"],
        **extra,
    )
    truth = {"case": case, "rank": rank, "raw_forward_steps": [], "clipped_steps": 0}
    times = {"attached": time.time()}
    try:
        for step in range(steps):
            on = step >= onset
            if step == onset:
                detection._write_json(out / f"{case}-onset-rank{rank}.json", {"t": time.time()})
                if case == "moved_after_wrap":
                    # e.g. a temporary move or cast to free accelerator memory, then back.
                    ddp.to(torch.float64)
                    ddp.to(torch.float32)
                if case == "skipped_collective" and mine:
                    truth["left_loop_at"] = step
                    detection._write_json(out / f"{case}-rank{rank}.json", truth)
                    dist.barrier()  # the end-of-training barrier: the others never reach it
                    return
            x, y, _ = detection._batch(opts["data_seed"], rank, step, bsz)
            if corrupt is not None:
                corrupt.armed = on
            sgd.zero_grad(set_to_none=True)
            raw = (
                case == "raw_module_forward"
                and mine
                and on
                and (step - onset) % RAW_FORWARD_EVERY == 0
            )
            if raw:
                truth["raw_forward_steps"].append(step)
            loss = F.cross_entropy((ddp.module if raw else ddp)(x), y)
            loss.backward()
            if case == "clip_one_rank" and mine and on:
                total = torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP_MAX_NORM)
                truth["clipped_steps"] += int(total > CLIP_MAX_NORM)
            sgd.step()
            if opts["step_interval"] > 0:
                time.sleep(opts["step_interval"])  # after the step time the shim measures
            mon.step(loss)
        times["trained"] = time.time()
        stats = mon.close(timeout=60)
        times["closed"] = time.time()
        # The raw-forward rank owes the others one all-reduce per skipped one: run the same
        # collective (a DDP backward, the monitor closed) so every rank can finish.
        for _ in truth["raw_forward_steps"]:
            x, y, _ = detection._batch(opts["data_seed"], rank, steps, bsz)
            F.cross_entropy(ddp(x), y).backward()
        healthy = set(range(WORLD)) - faulty_ranks(case)
        ref = min(healthy) if healthy else 0
        truth["params_differ_from_rank"] = ref
        truth["params_differ"] = detection._params_differ(ddp.module, ref)
        truth["agent"] = {k: stats.get(k) for k in ("recorded", "acked", "dropped", "unacked")}
        truth["steps_without_gradients"] = stats.get("shim_steps_without_gradients", 0)
        times["checked"] = time.time()
        truth["times"] = times
        detection._write_json(out / f"{case}-rank{rank}.json", truth)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---- collector, Prometheus ---------------------------------------------------------------------


def start_collector(binary: Path, tmp: Path, step_timeout: str):
    """detection.start_collector with the metrics endpoint Prometheus scrapes. Returns (process,
    grpc address, metrics port, db path, log path)."""
    return detection.start_collector(binary, tmp, step_timeout=step_timeout, metrics=True)


def start_prometheus(binary: str, tmp: Path, metrics_port: int, stall_seconds: float = 30):
    """deploy/prometheus.yml with the collector's address, 1 s scrape and evaluation intervals,
    the rules of deploy/prometheus/rules/ unchanged (plus one override: `stall_seconds` of the
    realbug-* jobs, the documented per-job mechanism) and no reachable Alertmanager (alerts are
    read from the API). Returns (process, base URL)."""
    import yaml

    overrides = tmp / "bench-overrides.yml"
    overrides.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "real-bugs-bench",
                        "rules": [
                            {
                                "record": "rankscope:threshold_override:stall_seconds",
                                "expr": "max by (train_job) (0 * rankscope_world_size"
                                f'{{train_job=~"realbug-.*"}}) + {stall_seconds}',
                            }
                        ],
                    }
                ]
            }
        )
    )

    config = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(REPO / "deploy" / "prometheus" / "rules" / "*.yml"), str(overrides)]
    config["alerting"]["alertmanagers"][0]["static_configs"] = [
        {"targets": [f"127.0.0.1:{detection.free_port()}"]}
    ]
    (scrape,) = [s for s in config["scrape_configs"] if s["job_name"] == "rankscope-collector"]
    scrape["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = detection.free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={path}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"prometheus did not start:\n{(tmp / 'prometheus.log').read_text()}")
        time.sleep(0.2)


class AlertWatcher(threading.Thread):
    """Polls /api/v1/alerts every `interval` s; keeps, per (alertname, labels), the wall time it
    was first seen pending and first seen firing."""

    def __init__(self, url, interval=2.0):
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.seen = {}  # (name, train_job, rank, signal/condition/scope) -> {state: time}
        self.errors = 0
        self._halt = threading.Event()

    def poll(self):
        try:
            with urllib.request.urlopen(self.url + "/api/v1/alerts", timeout=10) as r:
                alerts = json.load(r)["data"]["alerts"]
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            self.errors += 1
            return
        now = time.time()
        for a in alerts:
            lab = a["labels"]
            key = (
                lab.get("alertname"),
                lab.get("train_job", ""),
                lab.get("rank", ""),
                lab.get("signal") or lab.get("condition") or lab.get("scope") or "",
            )
            self.seen.setdefault(key, {}).setdefault(a["state"], now)

    def run(self):
        while not self._halt.wait(self.interval):
            self.poll()

    def stop(self):
        self._halt.set()
        self.join(10)
        self.poll()


# ---- scoring -----------------------------------------------------------------------------------

COLUMNS = ("outlier", "replica", "drifting", "slow", "missing", "integrity")


def read_rows(db: Path, job: str):
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute(
            "SELECT step, outlier_ranks, replica_divergent_ranks, drifting_ranks, slow_ranks,"
            " missing_ranks, CASE WHEN integrity_fault = '' THEN ''"
            " WHEN integrity_rank IS NULL THEN ? ELSE CAST(integrity_rank AS TEXT) END"
            " FROM step_stats WHERE job = ? ORDER BY step",
            (f"0-{WORLD - 1}", job),
        ).fetchall()
    finally:
        con.close()


def parse_ranks(text) -> set:
    """A step_stats rank list ("3,7") or missing_ranks' runs ("0-5,9") as a set."""
    return set(detection.parse_ranks(text))


def score_case(faulty: frozenset, onset: int, rows) -> dict:
    """From step_stats rows (step, then one rank list per COLUMNS): the first step at
    or after `onset` that names a faulty rank (all of them when `faulty` is every rank of the
    world), its column, the delay, the faulty ranks named per column, every wrong flag, and the
    last step stored. Pure (tests/python/test_real_bugs.py)."""
    every = len(faulty) == WORLD
    named_at, how, wrong, by_column = None, None, [], {}
    for row in rows:
        step = row[0]
        after = step >= onset
        for column, text in zip(COLUMNS, row[1:]):
            ranks = parse_ranks(text)
            if not ranks:
                continue
            bad, hit = detection.judge_flag(ranks, faulty, after)
            if bad:
                wrong.append((step, column, bad))
            if hit:
                by_column.setdefault(column, set()).update(hit)
            if named_at is None and hit and (not every or hit == faulty):
                named_at, how = step, column
    return {
        "named": named_at is not None,
        "named_at": named_at,
        "delay": None if named_at is None else named_at - onset,
        "how": how,
        "by_column": {c: sorted(r) for c, r in by_column.items()},
        "wrong": wrong,
        "last_step": rows[-1][0] if rows else None,
    }


# ---- the driver --------------------------------------------------------------------------------


def make_opts(steps, onset, step_interval, seed, tag=None):
    """The training options every rank gets; each case's job is named realbug-<case>-<tag>."""
    tag = tag or time.strftime("%H%M%S")
    return {
        "steps": steps,
        "onset": onset,
        "batch_size": 32,
        "lr": 0.1,
        "momentum": 0.9,
        "sketch_dim": 1024,
        "param_check_every": 5,
        "step_interval": step_interval,
        "data_seed": seed,
        "model_seed": seed + 1,
        "pg_timeout": 3600,
        "run_timeout": 1800 + steps * (step_interval + 0.5),
        "jobs": {c: f"realbug-{c}-{tag}" for c in CASES},
    }


def run_cases(cases, opts, collector, out_dir, hang_grace):
    """Spawns one 4-rank world per case, all at once; waits until every world that can finish
    has finished (the hung one is given `hang_grace` s more, then killed). Returns
    {case: (exitcodes or 'killed')}."""
    import torch.multiprocessing as mp

    worlds = {}
    for case in cases:
        worlds[case] = mp.start_processes(
            _worker,
            args=(detection.free_port(), case, opts, collector, str(out_dir)),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
    ended, deadline, reported = {}, None, {}
    limit = time.monotonic() + opts["run_timeout"]
    while len(ended) < len(worlds):
        for case, ctx in worlds.items():
            if case in ended:
                continue
            if all(not p.is_alive() for p in ctx.processes):
                ended[case] = [p.exitcode for p in ctx.processes]
            elif all((out_dir / f"{case}-rank{r}.json").exists() for r in range(WORLD)):
                # Every rank wrote its truth; a rank that does not exit soon after (seen at
                # interpreter exit on a loaded machine) is killed.
                reported.setdefault(case, time.monotonic())
                if time.monotonic() - reported[case] > EXIT_GRACE_S:
                    ended[case] = [p.exitcode for p in ctx.processes]
        others = [c for c in worlds if c != "skipped_collective"]
        if deadline is None and all(c in ended for c in others):
            deadline = time.monotonic() + hang_grace
        if (deadline is not None and time.monotonic() > deadline) or time.monotonic() > limit:
            break
        time.sleep(0.5)
    for case, ctx in worlds.items():
        codes = []
        for r, p in enumerate(ctx.processes):
            if p.is_alive():
                wrote = (out_dir / f"{case}-rank{r}.json").exists()
                p.kill()
                p.join()
                codes.append("killed after reporting" if wrote else "killed")
            else:
                codes.append(p.exitcode)
        ended[case] = codes
    return ended


def ground_truth(case, out_dir, exits):
    files = [out_dir / f"{case}-rank{r}.json" for r in range(WORLD)]
    ranks = [json.loads(f.read_text()) if f.exists() else None for f in files]
    onset_t = [
        json.loads((out_dir / f"{case}-onset-rank{r}.json").read_text())["t"]
        for r in range(WORLD)
        if (out_dir / f"{case}-onset-rank{r}.json").exists()
    ]
    t = {"exits": exits, "onset_time": min(onset_t) if onset_t else None}
    done = [r for r in ranks if r is not None and "params_differ" in r]
    if done:
        t["params_differ"] = done[0]["params_differ"]
        t["params_differ_from_rank"] = done[0]["params_differ_from_rank"]
        t["steps_without_gradients"] = [r["steps_without_gradients"] for r in done]
        t["raw_forward_steps"] = sum((r["raw_forward_steps"] for r in done), [])
        t["clipped_steps"] = sum(r["clipped_steps"] for r in done)
        t["agent"] = [r["agent"] for r in done]
        t["train_s"] = round(
            max(r["times"]["trained"] for r in done) - min(r["times"]["attached"] for r in done), 1
        )
        t["close_s"] = round(max(r["times"]["closed"] - r["times"]["trained"] for r in done), 1)
    t["hung_ranks"] = [r for r, e in enumerate(exits) if e == "killed"]
    t["errors"] = {
        r: (out_dir / f"{case}-rank{r}.error").read_text()
        for r in range(WORLD)
        if (out_dir / f"{case}-rank{r}.error").exists()
    }
    t["left_loop"] = [r["rank"] for r in ranks if r is not None and "left_loop_at" in r]
    return t


def truth_text(case, t):
    if case == "skipped_collective":
        return f"rank {t['left_loop']} left the loop; ranks {t['hung_ranks']} never finished (hung)"
    s = f"weights differ from rank {t.get('params_differ_from_rank')}'s on ranks " + str(
        t.get("params_differ")
    )
    if case == "moved_after_wrap":
        s += f"; steps without a reduced bucket per rank {t.get('steps_without_gradients')}"
    if case == "raw_module_forward":
        s += f"; raw forwards at {t.get('raw_forward_steps')}"
    if case == "clip_one_rank":
        s += f"; clipping bound on {t.get('clipped_steps')} steps"
    return s


def named_text(r) -> str:
    if r["named"]:
        return "yes"
    if r.get("stalled_after_s") is not None:
        return f"stalled (job, no rank; RankscopeJobStalled {r['stalled_after_s']} s)"
    return "no"


def alerts_for(watcher, job, onset_time):
    out = []
    for (name, tj, rank, sig), states in sorted(watcher.seen.items()):
        if tj != job:
            continue
        firing = states.get("firing")
        pending = states.get("pending")
        out.append(
            {
                "alert": name + (f"{{rank={rank}}}" if rank else "") + (f"[{sig}]" if sig else ""),
                "firing_after_s": None
                if firing is None or onset_time is None
                else round(firing - onset_time, 1),
                "pending_after_s": None
                if pending is None or onset_time is None
                else round(pending - onset_time, 1),
            }
        )
    return out


# Long: a benchmark driver run by hand, read top to bottom: its flags, the set-up, the measured
# runs, the table it prints; the measured pieces are functions of their own.
def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="bench/real_bugs.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="cases: " + ", ".join(CASES),
    )
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated (default: all)")
    ap.add_argument(
        "--onset", type=int, default=20, help="the fault's first step (default: %(default)s)"
    )
    ap.add_argument(
        "--after-onset-seconds",
        type=float,
        default=170,
        help="how long the faulty jobs train after the onset: long enough for the rules' "
        "`for: 2m` (default: %(default)s)",
    )
    ap.add_argument(
        "--step-interval",
        type=float,
        default=0.5,
        help="seconds each rank sleeps after its optimizer step (default: %(default)s)",
    )
    ap.add_argument("--steps", type=int, help="override: steps per job")
    ap.add_argument(
        "--seed", type=int, default=36, help="data and model seed (default: %(default)s)"
    )
    ap.add_argument("--no-prometheus", action="store_true", help="score from SQLite only")
    ap.add_argument(
        "--hang-grace",
        type=float,
        default=10,
        help="seconds the hung job is watched after the others finished (default: %(default)s)",
    )
    ap.add_argument(
        "--stall-seconds",
        type=float,
        default=30,
        help="RankscopeJobStalled's stall_seconds for these jobs (default: %(default)s; the "
        "rule's default, 600, outlasts the run)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write every case's result here")
    args = ap.parse_args(argv)

    build = Path(args.build_dir).resolve()
    binary = build / "bin" / "rankscope-collector"
    if not binary.exists():
        ap.error(f"{binary} not found (build the project, or pass --build-dir)")
    sys.path.insert(0, str(build / "python"))  # the spawned ranks inherit sys.path
    prometheus = None if args.no_prometheus else shutil.which("prometheus")
    if not args.no_prometheus and prometheus is None:
        ap.error("prometheus not found on PATH (./run setup installs it), or pass --no-prometheus")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    steps = args.steps or args.onset + int(args.after_onset_seconds / max(args.step_interval, 0.01))
    opts = make_opts(steps, args.onset, args.step_interval, args.seed)
    print(
        f"real bugs: {len(cases)} cases x {WORLD} ranks, {steps} steps, onset {args.onset}, "
        f"step interval {args.step_interval} s, seed {args.seed}",
        flush=True,
    )
    t0 = time.monotonic()
    results = {}
    with tempfile.TemporaryDirectory(prefix="rankscope-realbugs-") as tmp:
        tmp = Path(tmp)
        col, address, metrics_port, db, _ = start_collector(binary, tmp, "2s")
        prom, watcher = None, None
        try:
            if prometheus:
                prom, url = start_prometheus(prometheus, tmp, metrics_port, args.stall_seconds)
                watcher = AlertWatcher(url)
                watcher.start()
                print(f"collector {address}, prometheus {url}", flush=True)
            out = tmp / "out"
            out.mkdir()
            exits = run_cases(cases, opts, address, out, args.hang_grace)
            if watcher:
                watcher.stop()
            for case in cases:
                truth = ground_truth(case, out, exits[case])
                scored = score_case(
                    faulty_ranks(case), args.onset, read_rows(db, opts["jobs"][case])
                )
                alerts = (
                    alerts_for(watcher, opts["jobs"][case], truth["onset_time"]) if watcher else []
                )
                stalled = [
                    a["firing_after_s"]
                    for a in alerts
                    if a["alert"].startswith("RankscopeJobStalled")
                    and a["firing_after_s"] is not None
                ]
                results[case] = {
                    **scored,
                    "stalled_after_s": min(stalled) if stalled else None,
                    "truth": truth,
                    "alerts": alerts,
                }
        finally:
            for p in (prom, col):
                if p is not None:
                    p.send_signal(signal.SIGTERM)
                    try:
                        p.wait(20)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    wall = time.monotonic() - t0

    print()
    print(
        "| case | faulty | named? | which rank (column) | steps after onset | wrong flags | "
        "alerts (firing s after onset) | last step stored | truth |"
    )
    print("|" + " --- |" * 9)
    for case in cases:
        r, f = results[case], CASES[case]["faulty"]
        cols = "; ".join(f"{c}: {','.join(map(str, v))}" for c, v in r["by_column"].items()) or "-"
        wrong = (
            "none"
            if not r["wrong"]
            else f"{len(r['wrong'])} (first: step {r['wrong'][0][0]} {r['wrong'][0][1]} "
            f"{','.join(map(str, r['wrong'][0][2]))})"
        )
        firing = [a for a in r["alerts"] if a["firing_after_s"] is not None]
        pending = [a for a in r["alerts"] if a["firing_after_s"] is None]
        al = ", ".join(f"{a['alert']} {a['firing_after_s']}" for a in firing) or "none"
        if pending:
            al += "; pending only: " + ", ".join(a["alert"] for a in pending)
        print(
            f"| {case} | {f} | {named_text(r)} | {cols} | "
            f"{detection.fmt(r['delay'])} | {wrong} | {al if watcher else 'not run'} | "
            f"{detection.fmt(r['last_step'])} | {truth_text(case, r['truth'])} |"
        )
    print()
    for case in cases:
        print(f"{case}: {CASES[case]['ref']}\n    {CASES[case]['mechanism']}")
    for case in cases:
        hung = results[case]["truth"]["hung_ranks"]
        for r, err in results[case]["truth"]["errors"].items():
            # The ranks of a hung job raise when their peers are killed at the end: expected.
            if not hung:
                print(f"\n{case} rank {r} failed:\n{err}")
    print(f"\nwall time {wall:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "wall_seconds": wall, "results": results}, indent=1)
        )
    return results


if __name__ == "__main__":
    main()
