"""The Hugging Face Trainer on accelerate's DDP and FSDP2 backends (2 gloo processes, CPU,
gradient accumulation 2) reporting to a real collector through rankscope.torch.attach(trainer)
and through the zero-code launch (rankscope.auto.install: the Trainer is attached when built).

The truth for each step comes from the micro-batches the Trainer fed each rank, run through a
reference replica (same weights): the local gradient is the sum over micro-batches of the
gradients of loss / gradient_accumulation_steps, the loss their mean; the collector's
statistics must equal it as the DDP truth tests require (shim_harness.check_exact_rows). Under
DDP the replicas' reduced gradients and parameters must agree. accelerate 1.15 builds FSDP only
on an accelerator: the FSDP2 runs set its state as on a GPU machine
(framework_harness.fsdp_on_cpu).
"""

import os

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

import framework_harness  # noqa: E402
import shim_harness  # noqa: E402

try:
    import transformers
except ImportError:
    if os.environ.get("RANKSCOPE_E2E_REQUIRED"):
        raise
    pytest.skip("transformers is not installed", allow_module_level=True)

WORLD = 2
STEPS = 3
SKETCH_DIM = 1024


@pytest.fixture(scope="module")
def run(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    shim_harness.spawn(
        framework_harness.huggingface_worker,
        WORLD,
        module_collector.address,
        "hf",
        str(out),
        STEPS,
        SKETCH_DIM,
        2,
        ["explicit", "fsdp-explicit", "auto", "fsdp-auto"],
        timeout=240,
    )
    return module_collector, out


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_trainer_ddp_statistics_equal_exact_values(run, mode):
    """explicit: rankscope.torch.attach(trainer); auto: the zero-code launch
    (rankscope.auto.install before the Trainer is built)."""
    collector, out = run
    infos, fps = framework_harness.check_framework_job(
        collector, out, f"hf-{mode}", mode, WORLD, STEPS, SKETCH_DIM
    )
    assert all(info["ddp_attachments"] == 0 for info in infos)
    assert all(info["model"] == "DistributedDataParallel" for info in infos)
    framework_harness.check_ddp_replicas(fps, STEPS)


@pytest.mark.parametrize("mode", ["fsdp-explicit", "fsdp-auto"])
def test_trainer_fsdp2_statistics_equal_exact_values(run, mode):
    """accelerate's FSDP2 backend (fsdp_version 2, gradient accumulation 2: FSDP2 reduces each
    micro-batch, and the step's norm is the exact norm of their sum from the first step);
    explicit attach and the zero-code launch. No replica fingerprints (no two ranks hold the
    same shard)."""
    collector, out = run
    infos, fps = framework_harness.check_framework_job(
        collector, out, f"hf-{mode}", mode, WORLD, STEPS, SKETCH_DIM, ("shim_accumulation_unseen",)
    )
    for info in infos:
        assert info["model"].startswith("FSDP"), info
        assert info["framework"] == f"transformers {transformers.__version__} fsdp2", info
    assert all(r[2] is None and r[3] is None for r in fps), fps


def test_trainer_without_ddp_is_refused_with_a_message_and_trains(tmp_path):
    """One process, no DDP model: one RuntimeWarning naming the transformers version and what
    the Trainer trains; training runs its steps unwatched."""
    import warnings

    import rankscope.torch as rst

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=framework_harness.LMForTrainer(),
        args=args,
        train_dataset=framework_harness.TokenData(),
    )
    cb = rst.attach(trainer, collector="127.0.0.1:1", job="refused")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    messages = [str(w.message) for w in caught if "rankscope" in str(w.message)]
    assert len(messages) == 1, messages
    assert f"transformers {transformers.__version__}" in messages[0]
    assert "LMForTrainer, not a DistributedDataParallel" in messages[0]
    assert cb.monitor is None and cb.refused == messages[0]
    assert trainer.state.global_step == 2
