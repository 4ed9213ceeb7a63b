"""FSDP2, FSDP1 and a compiled DDP model (gloo on CPU) reporting through rankscope.torch to a real
collector.

For every step the collector's statistics must equal the exact values the test computes from each
rank's full local gradient and loss on a reference replica of the unwrapped module
(fsdp_harness.exact_scenario; the same checks as DDP's truth tests, shim_harness.check_exact_rows):
loss and grad-norm dispersion and each rank's norm to float tolerance, direction consistency equal
to that of ideal sketches of the exact gradients and within the sketch's error of the exact cosine.
Under gradient accumulation each micro-batch is reduced (FSDP's default), and the step's local
gradient is the micro-batches' sum. The 2-rank scenarios share one set of processes, the 4-rank
HSDP run another, the bit-identity runs and the refusals a third.
"""

import inspect
import json
import os

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")
torch = pytest.importorskip("torch")

import fsdp_harness  # noqa: E402
import shim_harness  # noqa: E402

STEPS = 3
SKETCH_DIM = 1024


def _has_fsdp2_path() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return False
    return "_prepare_reduce_scatter_inputs" in inspect.getsource(FSDPParamGroup.__init__)


def _dynamo_supported() -> bool:
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported

        return bool(is_dynamo_supported())
    except Exception:
        return False


FSDP2 = _has_fsdp2_path()
COMPILE = _dynamo_supported()

# job -> (scenario, the steps it reports). Without FSDP2 (torch < 2.4, or a torch without what the
# path reads) or torch.compile (torch 2.2 on Python 3.12), those scenarios are left out.
SCENARIOS = {
    "fsdp1-full": ({"framework": "fsdp1", "mode": "FULL_SHARD"}, range(STEPS)),
    "fsdp1-noshard": ({"framework": "fsdp1", "mode": "NO_SHARD"}, range(STEPS)),
    # no_sync() on all micro-batches but the last: one reduction a step, of their sum.
    "fsdp1-nosync": (
        {"framework": "fsdp1", "mode": "FULL_SHARD", "accum": 2, "sync_last": True},
        range(STEPS),
    ),
    "fsdp1-accum": (
        {"framework": "fsdp1", "mode": "SHARD_GRAD_OP", "accum": 2, "keep": True},
        range(STEPS),
    ),
}
if FSDP2:
    SCENARIOS.update(
        {
            "fsdp2-shard": ({"framework": "fsdp2", "mode": "shard"}, range(STEPS)),
            "fsdp2-replicate": ({"framework": "fsdp2", "mode": "replicate"}, range(STEPS)),
            # Parameters without a gradient are left out of FSDP2's reduction: the rest is exact.
            "fsdp2-unused": (
                {"framework": "fsdp2", "mode": "shard", "unused": True},
                range(STEPS),
            ),
            # Each of 3 micro-batches is reduced; kept from the start, every step is exact.
            "fsdp2-accum": (
                {"framework": "fsdp2", "mode": "shard", "accum": 3, "keep": True},
                range(STEPS),
            ),
            # set_requires_gradient_sync(False) on all micro-batches but the last: one
            # reduction a step, of their sum; exact without a copy.
            "fsdp2-nosync": (
                {"framework": "fsdp2", "mode": "shard", "accum": 3, "sync_last": True},
                range(STEPS),
            ),
            # By default the sum is kept from the step after the first that reduced a parameter
            # twice: that step is not reported, the next ones are, exactly.
            "fsdp2-accum-auto": (
                {"framework": "fsdp2", "mode": "shard", "accum": 2},
                range(1, STEPS),
            ),
        }
    )
if COMPILE:
    # torch.compile of a DDP model: the default ddp_optimizer mode keeps DDP's C++ reducer and
    # its bucket hooks, so the values are eager DDP's.
    SCENARIOS["compiled-ddp"] = ({"framework": "compile", "mode": "ddp_optimizer"}, range(STEPS))
    if os.environ.get("RANKSCOPE_TEST_INDUCTOR"):
        # The same with the inductor backend (C++ code generation with g++ on the CPU): minutes
        # of compilation on a 2-core machine, so only on request (docs/shim.md "Frameworks").
        SCENARIOS["compiled-ddp-inductor"] = (
            {"framework": "compile", "mode": "ddp_optimizer", "backend": "inductor"},
            range(STEPS),
        )

IDENTICAL = [("fsdp1", "FULL_SHARD"), ("fsdp1", "NO_SHARD")] + (
    [("fsdp2", "shard"), ("fsdp2", "replicate")] if FSDP2 else []
)


def load(path):
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def exact_runs(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-exact")
    shim_harness.spawn(
        fsdp_harness.exact_worker,
        2,
        module_collector.address,
        str(out),
        STEPS,
        SKETCH_DIM,
        {job: scenario for job, (scenario, _) in SCENARIOS.items()},
        timeout=400 + (1500 if "compiled-ddp-inductor" in SCENARIOS else 0),
    )
    return module_collector, out


def check(collector, out, job, world, reported_steps):
    expected = {int(k): v for k, v in load(out / f"{job}.expected.json").items()}
    expected = {s: e for s, e in expected.items() if s in reported_steps}
    shim_harness.check_exact_rows(
        collector.step_rows(job), collector.rank_rows(job), expected, world, SKETCH_DIM
    )
    results = [load(out / f"{job}.rank{r}.json") for r in range(world)]
    for r in results:
        s = r["stats"]
        assert s["recorded"] == len(reported_steps) and s["acked"] == len(reported_steps), s
        assert s.get("shim_hook_errors", 0) == 0 and s.get("shim_unknown_parameters", 0) == 0
    return results


@pytest.mark.parametrize("job", list(SCENARIOS))
def test_collector_statistics_equal_exact_local_values(exact_runs, job):
    collector, out = exact_runs
    scenario, reported = SCENARIOS[job]
    results = check(collector, out, job, 2, reported)
    if job == "fsdp2-accum-auto":
        assert all(r["stats"]["shim_accumulation_unseen"] == 1 for r in results)
    if scenario.get("sync_last"):
        assert all(r["stats"].get("shim_accumulation_unseen", 0) == 0 for r in results)
    rows = collector.query(
        "SELECT step, rank, param_fingerprint, replica_ok FROM rank_steps WHERE job = ? "
        "ORDER BY step, rank",
        (job,),
    )
    fps = {(step, rank): pfp for step, rank, pfp, _ in rows}
    if scenario["mode"] in ("replicate", "NO_SHARD"):
        # Pure data parallelism: every rank holds the parameters whole; their fingerprints after
        # the first step are what the test computes, equal on both ranks, and the replicas agree.
        for rank, r in enumerate(results):
            assert r["param_fp"] is not None
            assert fps[(0, rank)] & (2**64 - 1) == r["param_fp"]
        assert results[0]["param_fp"] == results[1]["param_fp"]
        # The collector found the replicas in agreement where it had fingerprints to compare
        # (NULL: a step without any).
        assert [ok for step, _, _, ok in rows if step == 0] == [1, 1], rows
        assert all(ok in (1, None) for *_, ok in rows), rows
    elif scenario["framework"] != "compile":
        # Shards: nothing two ranks hold is the same, so no fingerprint is sent.
        assert all(v is None for v in fps.values()), fps
    # The aggregation check: where a rank holds the whole reduced gradient after the hook (DDP
    # under torch.compile, FSDP1 NO_SHARD) or at the end of the backward (FSDP2 replicate) every
    # step is checked and clean; the other modes send no reduced sketch (docs/shim.md's
    # Integrity notes).
    checks = collector.query(
        "SELECT step, integrity_error_ratio, integrity_fault FROM step_stats WHERE job = ? "
        "ORDER BY step",
        (job,),
    )
    assert [c[0] for c in checks] == list(reported), checks
    if scenario["framework"] == "compile" or scenario["mode"] in ("NO_SHARD", "replicate"):
        assert all(r is not None and r <= 1.0 and f == "" for _, r, f in checks), checks
    else:
        assert all(r is None for _, r, _ in checks), checks


@pytest.mark.skipif(
    not FSDP2, reason=f"torch {torch.__version__} has no FSDP2 path rankscope reads"
)
def test_fsdp2_hsdp_reports_exact_local_values_of_all_four_ranks(module_collector, tmp_path):
    """HSDP on a 2 x 2 mesh (replicate x shard): rank r holds shard r % 2, so the replica sets
    are {0, 2} and {1, 3}. An odd feed-forward width shards some parameters unevenly. Each rank
    sends its local shards' fingerprint with its shard index; the collector compares the
    replicas of each shard index, never shards against shards. At the last step rank 3 adds
    1e-3 to one value of its shard after the optimizer step: its set has two replicas that
    disagree and no majority, so both its ranks (1 and 3) are named, and never the other set."""
    job = "fsdp2-hsdp"
    shim_harness.spawn(
        fsdp_harness.exact_worker,
        4,
        module_collector.address,
        str(tmp_path),
        2,
        SKETCH_DIM,
        {
            job: {
                "framework": "fsdp2",
                "mode": "hsdp",
                "ff": 63,
                "param_check_every": 1,
                "perturb": {"rank": 3, "step": 1},
            }
        },
        timeout=240,
    )
    results = check(module_collector, tmp_path, job, 4, range(2))
    # What each rank fingerprints: its local shards, the same shapes on both replicas of a shard
    # index; the two shard indices differ (uneven shards of the 63-wide layer).
    shapes = [r["shapes"] for r in results]
    assert shapes[0] == shapes[2] and shapes[1] == shapes[3]
    assert shapes[0] != shapes[1], shapes
    # After step 0 the replicas of a shard index hold the same bits, the shards do not.
    fps = [r["param_fp"] for r in results]
    assert fps[0] == fps[2] and fps[1] == fps[3] and fps[0] != fps[1], fps
    rows = module_collector.query(
        "SELECT step, rank, param_fingerprint, replica_ok FROM rank_steps WHERE job = ? "
        "ORDER BY step, rank",
        (job,),
    )
    assert [(s, r) for s, r, *_ in rows] == [(s, r) for s in range(2) for r in range(4)], rows
    assert [pfp & (2**64 - 1) for s, _, pfp, _ in rows if s == 0] == fps
    # Step 0 clean: every replica agrees; step 1: rank 3 (and its replica, rank 1) named.
    assert [ok for *_, ok in rows] == [1, 1, 1, 1, 1, 0, 1, 0], rows
    verdicts = module_collector.query(
        "SELECT step, replica_checked, replica_divergent_ranks FROM step_stats WHERE job = ? "
        "ORDER BY step",
        (job,),
    )
    assert verdicts == [(0, 1, ""), (1, 1, "1,3")], verdicts


@pytest.fixture(scope="module")
def checks_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-checks")
    shim_harness.spawn(fsdp_harness.checks_worker, 2, str(out), IDENTICAL, timeout=300)
    return out


@pytest.mark.parametrize("framework,mode", IDENTICAL)
def test_training_is_bit_identical_with_and_without_rankscope(checks_run, framework, mode):
    """Two micro-batches a step, each reduced: after every step the watched model's parameters
    equal the unwatched one's bit for bit."""
    for r in range(2):
        out = load(checks_run / f"identical-{framework}-{mode}.rank{r}.json")
        assert out["same"] == [True, True, True], out
        assert out["errors"] == 0 and out["buckets"] > 0, out  # rankscope did see gradients


def test_fsdp1_hybrid_shard_is_refused_with_one_message_and_training_goes_on(checks_run):
    for r in range(2):
        out = load(checks_run / f"hybrid.rank{r}.json")
        assert len(out["messages"]) == 1, out
        msg = out["messages"][0]
        assert "HYBRID_SHARD" in msg and f"torch {torch.__version__}" in msg, msg
        assert "unwatched" in msg
        assert out["steps"] == 2 and "unwatched" in out["stats"]


def test_ddp_in_python_reducer_mode_is_refused_with_one_message(checks_run):
    """Compiled autograd's python_reducer mode calls DDP comm hooks per parameter inside the
    compiled backward: attach refuses it with one message, and training goes on."""
    if not load(checks_run / "python-reducer.rank0.json")["python_reducer"]:
        pytest.skip(f"torch {torch.__version__} has no python_reducer mode")
    for r in range(2):
        out = load(checks_run / f"python-reducer.rank{r}.json")
        assert len(out["messages"]) == 1, out
        msg = out["messages"][0]
        assert "python_reducer" in msg and f"torch {torch.__version__}" in msg, msg
        assert "unwatched" in out["stats"]


@pytest.mark.skipif(
    not FSDP2, reason=f"torch {torch.__version__} has no FSDP2 path rankscope reads"
)
def test_fsdp2_submodule_is_refused_as_not_the_local_gradient(checks_run):
    """A submodule's gradient is part of the rank's local gradient, not all of it: attach on one
    (once FSDP2 knows its root) is refused with one message."""
    for r in range(2):
        out = load(checks_run / f"non-root.rank{r}.json")
        assert len(out["messages"]) == 1, out
        assert "not the root" in out["messages"][0] and "unwatched" in out["stats"]
