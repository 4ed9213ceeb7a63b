"""Watching jobs started without rankscope (issue 10): `rankscope attach --pid` into live gloo DDP
ranks that never imported rankscope (tests/python/attach_target.py), and the zero-code launch
(`python -m rankscope.run`, RANKSCOPE_AUTO=1), against a real collector.

Every wait polls a condition against a deadline; the job stops itself a fixed number of steps
after the test asks (rank 0 decides, one broadcast per step), so no rank ever hangs.
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

from conftest import CLI_BIN, child_pythonpath, free_port, wait_until  # noqa: E402

TARGET = Path(__file__).resolve().parent / "attach_target.py"
PY = sys.executable  # the project's environment, with torch
WORLD = 4


def target_env(extra=None):
    """The job's environment: no rankscope settings (it finds tests/python for the model; the
    harness's conftest, which it imports, keeps RANKSCOPE_TEST_INSTALLED: the package under test
    is the installed one, not the build's)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RANKSCOPE_") or k == "RANKSCOPE_TEST_INSTALLED"
    }
    env["PYTHONPATH"] = str(TARGET.parent)
    env.update(extra or {})
    return env


class Job:
    """A running attach_target.py job: one process per rank."""

    def __init__(self, work: Path, world=WORLD, args=(), launcher=(), env=None):
        self.dir = Path(work)
        self.dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.procs = []
        for r in range(world):
            cmd = [
                PY,
                *launcher,
                str(TARGET),
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--dir",
                str(self.dir),
                *args,
            ]
            log = open(self.dir / f"rank{r}.log", "w")
            self.procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or target_env())
            )
        self.world = world

    @property
    def pids(self):
        return [p.pid for p in self.procs]

    def progress(self) -> int:
        try:
            return int((self.dir / "progress").read_text())
        except (OSError, ValueError):
            return -1

    def wait_progress(self, step: int, timeout=120.0):
        def ok():
            for r, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise AssertionError(
                        f"rank {r} exited {p.returncode}: "
                        f"{(self.dir / f'rank{r}.log').read_text()[-2000:]}"
                    )
            return self.progress() >= step

        wait_until(ok, timeout, f"the job to reach step {step}")

    def stop_after(self, steps: int) -> None:
        (self.dir / "stop").write_text(str(steps))

    def join(self, timeout=120.0):
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            self.kill()
        for r, p in enumerate(self.procs):
            assert p.returncode == 0, (
                f"rank {r} exited {p.returncode}: {(self.dir / f'rank{r}.log').read_text()[-3000:]}"
            )

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def finals(self):
        return [json.loads((self.dir / f"final.{r}").read_text()) for r in range(self.world)]

    def expected(self):
        return {int(k): v for k, v in json.loads((self.dir / "expected.json").read_text()).items()}


def attach(collector, job, pids, *flags, timeout=120):
    if not CLI_BIN.exists():
        pytest.skip(f"{CLI_BIN} not built")
    return subprocess.run(
        [
            str(CLI_BIN),
            "attach",
            f"--job={job}",
            f"--collector={collector.address}",
            *flags,
            *[str(p) for p in pids],
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_steps(out: str):
    return [int(s) for s in re.findall(r"(?:reporting|dormant) from step (\d+)", out)]


def check_exact(collector, job, expected, first, last, world=WORLD):
    rows = collector.step_rows(job)
    assert sorted(rows) == list(range(first, last + 1)), f"steps stored for {job}"
    ranks = {}
    for step, rank, loss, gn, _ in collector.rank_rows(job):
        ranks.setdefault(step, {})[rank] = (loss, gn)
    for step in range(first, last + 1):
        r, e = rows[step], expected[step]
        assert r["ranks"] == world and r["missing_ranks"] == "", (step, r)
        assert r["loss_mean"] == pytest.approx(statistics.fmean(e["losses"]), rel=1e-6)
        assert r["loss_std"] == pytest.approx(statistics.pstdev(e["losses"]), rel=1e-4, abs=1e-7)
        assert r["grad_norm_mean"] == pytest.approx(statistics.fmean(e["norms"]), rel=1e-6)
        assert [ranks[step][k][1] for k in range(world)] == pytest.approx(e["norms"], rel=1e-6)
        assert [ranks[step][k][0] for k in range(world)] == pytest.approx(e["losses"], rel=1e-6)
        assert abs(r["grad_cosine_mean"] - e["cosine"]) < 4 * (2 / 1024) ** 0.5


def test_attach_to_running_job_reports_every_step_exactly(module_collector, tmp_path):
    job = Job(tmp_path / "attached")
    try:
        job.wait_progress(5)
        out = attach(module_collector, "live-exact", job.pids)
        assert out.returncode == 0, out.stdout + out.stderr
        starts = start_steps(out.stdout)
        assert len(starts) == WORLD and len(set(starts)) == 1, out.stdout
        assert out.stdout.count("path: comm hook") == WORLD, out.stdout
        assert len(re.findall(r"pause [\d.]+ s", out.stdout)) == WORLD
        first = starts[0]
        assert first > 5
        job.stop_after(12)
    except BaseException:  # a failed assertion must not leave the job training
        job.kill()
        raise
    job.join()
    finals = job.finals()
    last = finals[0]["steps"] - 1
    assert last >= first + 11
    check_exact(module_collector, "live-exact", job.expected(), first, last)
    # The weights are those of the same run without rankscope (power-of-two world size).
    assert len({f["sha256"] for f in finals}) == 1
    ref = Job(tmp_path / "reference", args=("--total", str(last + 1)))
    ref.join()
    assert ref.finals()[0]["sha256"] == finals[0]["sha256"]


def test_second_attach_is_a_noop_and_errors_name_the_fix(module_collector, tmp_path):
    job = Job(tmp_path / "job", world=2)
    try:
        job.wait_progress(3)
        out = attach(module_collector, "live-twice", job.pids, "--dormant")
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("dormant from step") == 2, out.stdout
        again = attach(module_collector, "live-twice", job.pids)
        assert again.returncode == 0, again.stdout + again.stderr
        assert again.stdout.count("already attached") == 2, again.stdout

        # Not a Python process: the collector.
        out = attach(module_collector, "x", [module_collector.proc.pid])
        assert out.returncode == 1 and "is not a Python process" in out.stderr, out.stderr
        # No such process.
        out = attach(module_collector, "x", [2**22 + 12345])
        assert out.returncode == 1 and "no such process" in out.stderr, out.stderr
        # gdb missing.
        out = attach(module_collector, "x", job.pids[:1], "--gdb=/nonexistent/gdb")
        assert out.returncode == 1 and "gdb not found" in out.stderr, out.stderr
        # Not permitted: an unprivileged user (uid nobody, no CAP_SYS_PTRACE) attaching to
        # root's process. It keeps CAP_DAC_READ_SEARCH alone, to reach the project's Python
        # under root's home (pyenv's), which a real user would have installed where they can.
        if os.geteuid() == 0:
            out = subprocess.run(
                [
                    "setpriv",
                    "--reuid=65534",
                    "--regid=65534",
                    "--clear-groups",
                    "--inh-caps=+dac_read_search",
                    "--ambient-caps=+dac_read_search",
                    str(CLI_BIN),
                    "attach",
                    "--job=x",
                    str(job.pids[0]),
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 1, out.stderr
            assert "CAP_SYS_PTRACE" in out.stderr and "shareProcessNamespace" in out.stderr
    finally:
        job.stop_after(1)
        job.join()


LOOP = "print('ready', flush=True); [time.sleep(0.05) for _ in range(12000)]"
PLAIN_PYTHON = {
    "torch is not imported": "import time; " + LOOP,
    "torch.distributed is not initialized": "import time, torch; " + LOOP,
    "no torch.nn.parallel.DistributedDataParallel model": "import time, torch, torch.distributed as dist; "
    "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:%d', rank=0, "
    "world_size=1); " + LOOP,
    "rankscope is not importable": "import sys, time; sys.modules['rankscope'] = None; " + LOOP,
}


def _assert_running(pid):
    st = Path(f"/proc/{pid}/status").read_text()
    assert "TracerPid:\t0" in st and not re.search(r"State:\s+[Tt]", st), st


@pytest.mark.parametrize("message", list(PLAIN_PYTHON))
def test_attach_errors_from_inside_the_process(module_collector, message):
    code = PLAIN_PYTHON[message]
    if "%d" in code:
        code = code % free_port()
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True, env=target_env())
    try:
        assert proc.stdout.readline().strip() == "ready"
        out = attach(module_collector, "x", [proc.pid])
        assert out.returncode == 1, out.stdout + out.stderr
        assert message in out.stderr, out.stderr
        _assert_running(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_signals_during_the_injected_calls_reach_the_process_and_attach_completes(
    module_collector, tmp_path
):
    """A process that is sent signals all along (here SIGUSR1, with a handler that counts them)
    while gdb runs mmap, dlopen and the helper inside it: a signal pending when gdb resumes a
    thread into one of those calls must go to the process's handler, not stop gdb inside the
    call (which failed the attach and left the process to return into gdb's dummy frame)."""
    count = tmp_path / "hits"
    code = (
        "import signal, sys, time\n"
        "hits = [0]\n"
        "signal.signal(signal.SIGUSR1, lambda *a: hits.__setitem__(0, hits[0] + 1))\n"
        "print('ready', flush=True)\n"
        "for _ in range(12000):\n"
        "    time.sleep(0.05)\n"
        "    open(sys.argv[1] + '.tmp', 'w').write(str(hits[0]))\n"
        "    __import__('os').replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
    )
    proc = subprocess.Popen(
        [PY, "-c", code, str(count)], stdout=subprocess.PIPE, text=True, env=target_env()
    )
    stop = threading.Event()
    sent = [0]

    def send():
        while not stop.is_set():  # a steady stream, so one is pending whenever gdb resumes
            os.kill(proc.pid, signal.SIGUSR1)
            sent[0] += 1
            time.sleep(0.0005)

    sender = threading.Thread(target=send)
    try:
        assert proc.stdout.readline().strip() == "ready"
        sender.start()
        out = attach(module_collector, "x", [proc.pid])
        stop.set()
        sender.join()
        # The payload ran inside the process: its own error, not gdb's.
        assert out.returncode == 1, out.stdout + out.stderr
        assert "torch is not imported" in out.stderr, out.stderr
        assert "gdb could not run" not in out.stderr and "was undone" not in out.stderr
        _assert_running(proc.pid)
        wait_until(
            lambda: count.exists() and int(count.read_text() or 0) > 0,
            60,
            "the process to count the signals it was sent",
        )
        assert sent[0] > 0
    finally:
        stop.set()
        if sender.is_alive():
            sender.join()
        proc.kill()
        proc.wait()


def test_a_main_thread_that_never_returns_to_python_is_queued_not_run(module_collector):
    proc = subprocess.Popen(
        [PY, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
        env=target_env(),
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        out = attach(module_collector, "x", [proc.pid], "--timeout=3")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "queued, not run" in out.stderr, out.stderr
        _assert_running(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_zero_code_launch_with_accumulation_and_a_framework(module_collector, tmp_path):
    """`python -m rankscope.run --enabled --sketch_encoding=float16 train.py`: a DDP built inside
    a framework class, three micro-batches per step; the reported loss is their mean."""
    steps = 16
    job = Job(
        tmp_path / "run",
        args=("--framework", "--accum", "3", "--total", str(steps)),
        launcher=(
            "-m",
            "rankscope.run",
            "--job=zero-code",
            "--enabled",
            "--sketch_encoding=float16",
            f"--collector={module_collector.address}",
        ),
        env=target_env({"PYTHONPATH": child_pythonpath(TARGET.parent)}),
    )
    job.join()
    rows = module_collector.step_rows("zero-code")
    assert rows, "nothing reported"
    # 4 KiB of float16 bins: k = 2,048 (the launcher's options reach attach).
    assert module_collector.query("SELECT sketch_dim FROM jobs WHERE job = 'zero-code'") == [
        (2048,)
    ]
    first = min(rows)
    assert first <= 6  # agreed at the first forward, plus the agreement's lead
    check_exact(module_collector, "zero-code", job.expected(), first, steps - 1)


def test_auto_env_with_own_comm_hook_uses_parameter_hooks(module_collector, tmp_path):
    """RANKSCOPE_AUTO=1 with a model that has its own comm hook: per-parameter gradient hooks,
    with gradient accumulation (the local gradient includes the no_sync micro-batches)."""
    steps = 14
    env = target_env(
        {
            "PYTHONPATH": child_pythonpath(TARGET.parent, autostart=True),
            "RANKSCOPE_AUTO": "1",
            "RANKSCOPE_JOB": "auto-hooks",
            "RANKSCOPE_DORMANT": "0",
            "RANKSCOPE_COLLECTOR": module_collector.address,
        }
    )
    job = Job(
        tmp_path / "auto", args=("--own-hook", "--accum", "2", "--total", str(steps)), env=env
    )
    job.join()
    rows = module_collector.step_rows("auto-hooks")
    assert rows, "nothing reported"
    check_exact(module_collector, "auto-hooks", job.expected(), min(rows), steps - 1)


def test_attach_to_zero_job_names_the_rank_that_missed_a_shard(module_collector, tmp_path):
    """DDP + ZeroRedundancyOptimizer: attach works, and rank 1 keeping its old copy of rank 0's
    shard after one step (the replicas diverge) is named by the parameter fingerprint. ZeRO
    broadcasts every shard again at the next step, which heals this fault, so the parameters are
    checked at every step here."""
    job = Job(tmp_path / "zero", args=("--zero", "--skip-shard-at", "-1"))
    try:
        job.wait_progress(3)
        out = attach(module_collector, "live-zero", job.pids, "--param_check_every=1")
        assert out.returncode == 0, out.stdout + out.stderr
        first = start_steps(out.stdout)[0]
        (job.dir / "skip").write_text("now")
        job.stop_after(12)
    finally:
        job.join()
    rows = module_collector.query(
        "SELECT step, replica_divergent_ranks FROM step_stats WHERE job = ? AND step >= ? "
        "ORDER BY step",
        ("live-zero", first),
    )
    named = [(s, r) for s, r in rows if r]
    assert [r for _, r in named] == ["1"], rows


def test_torchrun_zero_code_launch_then_attach_all_local(module_collector, tmp_path):
    """`torchrun -m rankscope.run` (dormant by default) -> `rankscope attach --all-local` finds
    both ranks and says they are already attached -> `ctl enable` starts the reports."""
    work = tmp_path / "torchrun"
    work.mkdir()
    env = target_env(
        {
            "PYTHONPATH": child_pythonpath(TARGET.parent),
            "RANKSCOPE_COLLECTOR": module_collector.address,
            "OMP_NUM_THREADS": "1",
        }
    )
    launcher = subprocess.Popen(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            # each rank's stdout to a log file and echoed
            "--redirects=1",
            "--tee=1",
            f"--log_dir={work / 'logs'}",
            "-m",
            "rankscope.run",
            "--job=torchrun-job",
            str(TARGET),
            "--dir",
            str(work),
        ],
        stdout=open(work / "torchrun.log", "w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    job = Job.__new__(Job)
    job.dir, job.world, job.procs = work, 2, []
    try:
        wait_until(
            lambda: launcher.poll() is None and job.progress() >= 3,
            120,
            "the torchrun job to train",
        )
        out = attach(module_collector, "torchrun-job", [], "--all-local")
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("already attached") == 2, out.stdout
        wait_until(
            lambda: module_collector.query("SELECT 1 FROM jobs WHERE job = ?", ("torchrun-job",)),
            60,
            "the dormant hello",
        )
        assert module_collector.step_rows("torchrun-job") == {}
        module_collector.ctl("enable", "torchrun-job", "--lead_steps=3")
        wait_until(
            lambda: len(module_collector.step_rows("torchrun-job")) >= 5,
            60,
            "5 steps reported after ctl enable",
        )
        job.stop_after(3)
        assert launcher.wait(timeout=120) == 0, (work / "torchrun.log").read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    for step, r in module_collector.step_rows("torchrun-job").items():
        assert r["ranks"] == 2 and r["missing_ranks"] == "", (step, r)


# ---- FSDP2: the zero-code launch and `rankscope attach --pid` (rankscope._fsdp2_attach) -------

FSDP2_SKETCH_DIM = 1024


def _fsdp2_available() -> bool:
    try:
        from rankscope.frameworks import fsdp2

        return fsdp2.fsdp_module_class() is not None
    except Exception:
        return False


needs_fsdp2 = pytest.mark.skipif(not _fsdp2_available(), reason="this torch has no FSDP2")


def check_fsdp2_exact(collector, job_name, job, steps):
    """Every step of ``steps`` stored, complete, and equal to the exact statistics of the ranks'
    own losses and full local gradients (attach_target.py --save-grads), as test_fsdp.py checks
    FSDP2 in the script (shim_harness.check_exact_rows)."""
    import torch

    from rankscope import DEFAULT_SKETCH_SEED
    from shim_harness import check_exact_rows, exact_step_stats

    saved = torch.load(job.dir / "grads.pt")
    expected = {
        s: exact_step_stats(
            saved[s][0], list(saved[s][1]), FSDP2_SKETCH_DIM, DEFAULT_SKETCH_SEED, "float32"
        )
        for s in steps
    }
    check_exact_rows(
        collector.step_rows(job_name),
        collector.rank_rows(job_name),
        expected,
        job.world,
        FSDP2_SKETCH_DIM,
    )


def run_zero_code_exact(collector, tmp_path, flag: str, job_name: str, steps: int) -> None:
    """Runs attach_target.py ``flag`` (two micro-batches a step) for ``steps`` steps on 2 ranks
    under `python -m rankscope.run --enabled`, then checks every step from the agreed one (0 +
    LEAD: the monitor is installed before any optimizer step on both ranks) exact."""
    from rankscope._attach_agreement import LEAD

    job = Job(
        tmp_path / "run",
        world=2,
        args=(flag, "--accum", "2", "--total", str(steps), "--save-grads"),
        launcher=(
            "-m",
            "rankscope.run",
            f"--job={job_name}",
            "--enabled",
            f"--sketch_dim={FSDP2_SKETCH_DIM}",
            f"--collector={collector.address}",
        ),
        env=target_env({"PYTHONPATH": child_pythonpath(TARGET.parent)}),
    )
    job.join()
    check_fsdp2_exact(collector, job_name, job, range(LEAD, steps))


@needs_fsdp2
def test_zero_code_launch_finds_fsdp2_models(module_collector, tmp_path):
    """`python -m rankscope.run --enabled train.py` for a script that shards its model with FSDP2
    (fully_shard, two micro-batches a step): the root is found at its first forward, the ranks
    agree on the first step on their optimizer-step count (0 on every rank then), and every step
    from the agreed one is exact."""
    steps = 9
    run_zero_code_exact(module_collector, tmp_path, "--fsdp2", "zero-code-fsdp2", steps)


def test_zero_code_launch_finds_fsdp1_roots(module_collector, tmp_path):
    """`python -m rankscope.run --enabled train.py` for a script that wraps its model with FSDP1
    (FULL_SHARD, the block a nested unit, two micro-batches a step under no_sync, a full state
    dict read before the first forward): only the root is attached, at its first forward,
    through the comm hook; the ranks agree on the first step on their optimizer-step count, and
    every step from the agreed one is exact."""
    from rankscope._attach_agreement import LEAD

    steps = LEAD + 3
    run_zero_code_exact(module_collector, tmp_path, "--fsdp1", "zero-code-fsdp1", steps)


def test_zero_code_launch_finds_megatron_ddp(module_collector, tmp_path):
    """`python -m rankscope.run --enabled train.py` for a script that trains with megatron-core's
    DistributedDataParallel (two micro-batches a step, each loss divided by two before backward):
    the model is found when built, attached at its first forward through its buckets'
    start_grad_sync; the ranks agree on the first step on their optimizer-step count, and every
    step from the agreed one is exact (the step's loss: the sum of the divided losses)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:  # not imported here: only the job needs it
        if os.environ.get("RANKSCOPE_E2E_REQUIRED"):  # CI installs it
            raise ImportError("megatron-core is not installed")
        pytest.skip("megatron-core is not installed")
    from rankscope._attach_agreement import LEAD

    steps = LEAD + 3
    run_zero_code_exact(module_collector, tmp_path, "--megatron", "zero-code-megatron", steps)


@needs_fsdp2
def test_attach_to_running_fsdp2_job_reports_every_step_exactly(module_collector, tmp_path):
    """`rankscope attach --pid` into a live FSDP2 job (Adam, which counts its steps): both ranks
    agree on the first step through the collectives they issued, number their steps by the
    optimizer's count, and every step from the agreed one is exact."""
    job = Job(tmp_path / "fsdp2", world=2, args=("--fsdp2", "--adam", "--save-grads"))
    try:
        job.wait_progress(3)
        out = attach(module_collector, "live-fsdp2", job.pids, f"--sketch_dim={FSDP2_SKETCH_DIM}")
        assert out.returncode == 0, out.stdout + out.stderr
        starts = start_steps(out.stdout)
        assert len(starts) == 2 and len(set(starts)) == 1, out.stdout
        assert out.stdout.count("path: FSDP2 FSDP: reduce-scatter inputs") == 2, out.stdout
        assert out.stdout.count("step boundary: Adam.step post-hook") == 2, out.stdout
        first = starts[0]
        assert first > 3
        job.stop_after(6)
    except BaseException:  # a failed assertion must not leave the job training
        job.kill()
        raise
    job.join()
    last = job.finals()[0]["steps"] - 1
    assert last >= first + 5
    check_fsdp2_exact(module_collector, "live-fsdp2", job, range(first, last + 1))


def _run_clock_starts(kind, world, arrivals, per_step, run_ahead, seed, optimizer_count):
    """Drives ``world`` ranks' ClockStarts (rankscope._fsdp2_attach) through one real c10d store
    (HashStore) over a training whose step k ends with the collective clock at ``clock[k]``
    (``per_step(k)`` collectives in step k). Rank r is installed before step ``arrivals[r]`` and
    sees every boundary (end of a step) from then on; the ranks' boundaries interleave at random,
    no rank processing boundary k + 1 + ``run_ahead`` before every rank processed boundary k
    (``run_ahead`` 0: a step's collectives complete only once every rank issued them, so nobody
    ends step k + 1 before everybody ended step k). Returns, per rank, (the global step it reports
    first, the number it gives that step)."""
    import random

    import torch.distributed as dist

    from rankscope._fsdp2_attach import CLOCK_STEPS, ClockStart

    rng = random.Random(seed)
    store = dist.HashStore()
    steps = 80
    clock = []
    for k in range(steps):
        clock.append((clock[-1] if clock else 0) + per_step(k))
    starts = [None] * world
    if kind == CLOCK_STEPS:  # published at install, before any rank's first boundary
        starts = [ClockStart(store, "job/-", r, world, kind, lambda m: None) for r in range(world)]
    done = [0] * world  # boundaries each rank has passed: the next one ends step done[r]
    first = [None] * world
    while any(f is None for f in first):
        slowest = min(done)
        r = rng.choice([r for r in range(world) if done[r] <= slowest + run_ahead])
        k = done[r]
        assert k < steps, "a rank never started"
        done[r] += 1
        if first[r] is not None or k < arrivals[r]:
            continue
        if starts[r] is None:
            starts[r] = ClockStart(store, "job/-", r, world, kind, lambda m: None)
        value = k + 1 - arrivals[r] if kind == CLOCK_STEPS else clock[k]
        number = starts[r].at_boundary(value, lambda: optimizer_count(k))
        if number is not None:
            first[r] = (k + 1, number)  # the step after boundary k is its first reported one
    return first


@pytest.mark.parametrize("seed", range(20))
def test_fsdp2_clock_start_gives_every_rank_the_same_first_step_and_numbers(seed):
    """rankscope._fsdp2_attach.ClockStart, three ranks on a real store: whatever the order in
    which the ranks reach their step boundaries, and whenever each was attached,
    - in lockstep (nobody ends a step before everybody ended the one before) every rank starts
      at the same step, after every rank's arrival, with the same number;
    - with ranks running further ahead (a CPU that queues a GPU's collectives) a rank may start
      later than another, and every rank still gives every step the same number."""
    from rankscope._fsdp2_attach import CLOCK_COLLECTIVES, CLOCK_STEPS

    def irregular(k):  # collectives a step: an evaluation's extra all-reduces every 4th step
        return 5 + (3 if k % 4 == 0 else 0)

    arrivals = [(seed * 7 + 3 * r) % 9 for r in range(3)]
    for kind, count, arr in (
        (CLOCK_COLLECTIVES, lambda k: None, arrivals),  # SGD: numbered from 0
        (CLOCK_COLLECTIVES, lambda k: k + 1, arrivals),  # Adam: steps it took after step k
        (CLOCK_STEPS, lambda k: None, [0, 0, 0]),  # zero-code: installed before step 0
    ):
        lockstep = _run_clock_starts(kind, 3, arr, irregular, 0, seed, count)
        assert len(set(lockstep)) == 1, (kind, lockstep)
        step, number = lockstep[0]
        assert step > max(arr)
        if kind == CLOCK_STEPS or count(0) is not None:
            assert number == step  # the count numbers the training steps
        else:
            assert number == 0
        ahead = _run_clock_starts(kind, 3, arr, irregular, 6, seed, count)
        offsets = {number - step for step, number in ahead}
        assert len(offsets) == 1, (kind, ahead)  # one numbering on every rank
