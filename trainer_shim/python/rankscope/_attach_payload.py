"""What ``rankscope attach --pid`` runs inside a live training process.

The attaching side (rankscope.attach) writes a request (JSON: job, options, ack_path) and has
``_attach_helper.so`` queue ``run(request)`` as a pending call: it runs on the main thread at a
bytecode boundary. ``run`` finds the process's DDP models by exact type and its root FSDP2 modules
with ``gc``, hands them to the process's AutoAttacher (rankscope._autoattach,
rankscope._fsdp2_attach), and writes the acknowledgement file, then
rewrites it each time a model changes state (installed, agreed, reporting), so the attaching side
can say per process: attached at step N, which path, how long the main thread paused.

Contract: ``run`` never raises (everything, including KeyboardInterrupt, ends in the
acknowledgement as ``status: error`` with a message that names the fix); a second request in a
process whose models are all attached is a no-op answered ``status: already attached``.
"""

import json
import os
import sys
import time

# Options the request may pass through to rankscope.torch.attach.
_OPTIONS = (
    "collector",
    "sketch_dim",
    "sketch_bytes",
    "sketch_encoding",
    "sketch_threads",
    "every",
    "param_check_every",
    "local_batch_size",
    "auth_token",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "tls_target_name",
)


class _Ack:
    """The acknowledgement file: rewritten whole (write, then rename) at each change."""

    def __init__(self, path: str):
        self.path = path
        self.fields = {"pid": os.getpid(), "status": "running"}

    def write(self, **fields) -> None:
        self.fields.update(fields)
        self.fields["time"] = time.time()
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.fields, f)
            os.replace(tmp, self.path)
        except OSError:
            pass


def run(request: dict) -> None:
    t0 = time.perf_counter()
    ack = _Ack(request["ack_path"])
    try:
        _run(request, ack, t0)
    except BaseException as e:  # never into the interpreter: the ack says what went wrong
        ack.write(
            status="error", error=f"{type(e).__name__}: {e}", pause_s=time.perf_counter() - t0
        )


def _run(request: dict, ack: _Ack, t0: float) -> None:
    if "torch" not in sys.modules:
        ack.write(
            status="error",
            error="torch is not imported in this process: not a PyTorch "
            "training process (attach to the ranks, not to the launcher)",
        )
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        ack.write(
            status="error",
            error="torch.distributed is not initialized in this process "
            "(not a rank yet, or the launcher): attach once training has started",
        )
        return
    from rankscope import _autoattach, _fsdp2_attach

    models, optimizers = _autoattach.find_models_and_optimizers()
    existing = _autoattach.current()
    # An FSDP2 model that rst.attach in the script (or a framework's callback) watches.
    watched = [
        m
        for m in models
        if type(m) is not _autoattach.DDP
        and not (existing is not None and existing.covers(m))
        and _fsdp2_attach.is_watched(m)
    ]
    models = [m for m in models if all(m is not w for w in watched)]
    if not models:
        ack.write(
            status="error",
            error="the FSDP2 model of this process is already watched by rankscope (attach() in "
            "the script, or a framework's callback)"
            if watched
            else "no torch.nn.parallel.DistributedDataParallel model or root FSDP2 module "
            "(fully_shard, after its first forward) in this process (DDP matched by exact "
            "type; a trainer that reduces gradients itself needs rst.attach_reducer in the "
            "script)",
        )
        return
    job = str(request["job"])
    if existing is not None and all(existing.covers(m) for m in models):
        ack.write(
            status="already attached",
            job=existing.job,
            models=existing.describe(),
            pause_s=time.perf_counter() - t0,
        )
        return
    if existing is not None and existing.job != job:
        ack.write(
            status="error",
            error=f"already attached as job {existing.job!r}; a process reports to one job",
        )
        return
    options = {k: request[k] for k in _OPTIONS if request.get(k) not in (None, "")}
    attacher = _autoattach.get_or_create(job, bool(request.get("dormant")), options)
    attacher._on_change = lambda: ack.write(models=attacher.describe())
    attacher.remember_optimizers(optimizers)
    from rankscope import frameworks

    if frameworks.trainer_divides_losses(models):  # Hugging Face or Lightning
        attacher.capture.sum_losses = True
    for m in models:
        attacher.add(m)
    ack.write(
        status="installed", job=job, models=attacher.describe(), pause_s=time.perf_counter() - t0
    )
