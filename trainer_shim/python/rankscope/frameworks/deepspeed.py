"""DeepSpeed (ZeRO stages 0, 1, 2 and 3): ``attach(engine)``.

What is seen. DeepSpeed has no public hook before its reductions, and the flat buckets its
reduction entry points receive (``average_tensor`` for stages 1/2, stage 3's
``__avg_scatter_grads``, ``allreduce_bucket`` for stage 0) are not always the local gradient:
under gradient accumulation ZeRO-2 points the ``.grad`` of the parameters of this rank's partition
at the partition buffer that holds the *reduced* gradient of the earlier micro-batches
(``copy_grads_in_partition`` in 0.19.8), and the next backward adds the new local gradient into
it, so the next bucket holds "reduced so far + local". rankscope therefore reads each
parameter's local gradient where autograd produces it, before DeepSpeed's own hooks see it: a
tensor hook (``Tensor.register_hook``, public PyTorch API) on every trainable parameter of
``engine.module`` receives that micro-batch's gradient of ``loss / gradient_accumulation_steps``
(``engine.backward`` divides by it), full-sized in every stage (ZeRO-3 gathers the parameter for
its backward).

The step's local gradient is the sum over the step's micro-batches of these gradients: the
gradient of the mean micro-batch loss, the same vector DDP with ``no_sync`` all-reduces. ZeRO-2/3
reduce every micro-batch, but sketches add and norms do not, so the hooks add each micro-batch's
gradient into one float32 buffer in rankscope's flat order (memory: 4 bytes a parameter, the size
of an fp32 gradient; one add a parameter a micro-batch), and the whole buffer is sketched once
at the optimizer step: norm and sketch are exact, in all stages alike.

The step is ``engine.step()`` calls that advanced ``engine.global_steps`` (the accumulation
boundary); the loss is the mean of the losses given to ``engine.backward`` since the previous
step, or, from a caller that divided them by the accumulation steps itself and passes
``scale_wrt_gas=False`` (the Hugging Face Trainer), their sum: the mean micro-batch loss.
Replica fingerprints: stages 0, 1 and 2 keep a full copy of the (16-bit) parameters on every
rank, fingerprinted after the optimizer step every ``param_check_every`` steps; stage 3
partitions them (no replicas: no fingerprint). The reduced gradient is not fingerprinted in any
stage (ZeRO-1/2/3 leave each rank only its own partition of it).

Aggregation integrity (rankscope._integrity): ZeRO-0 all-reduces every parameter's gradient
whole (``buffered_allreduce_fallback``: ``allreduce_bucket`` then a copy back into ``.grad``)
at the end of the boundary micro-batch's ``engine.backward``, so between that and the optimizer
step (which clips, then steps) every ``param.grad`` holds the reduced mean gradient on every rank.
On the steps this rank checks, the wrapped ``engine.step`` sketches those ``.grad`` tensors before
calling DeepSpeed's (one C++ call on the CPU, a DeviceSketch launch a parameter on a GPU), with
the precision of the coarser of the gradient's dtype and ``communication_data_type``. Not checked
(``_integrity_unsupported`` says why): ZeRO-1/2/3 (partitioned), bf16 (BF16_Optimizer reduces
its own float32 copies of the gradients), MoE (expert gradients are reduced over other groups),
sequence or pipeline parallelism (other divisors and groups), ``gradient_average`` off, and a
script that reduces the gradients itself (``enable_backward_allreduce`` off).

Refused, with one warning naming the version and mode, the engine left unwatched: DeepSpeed
versions outside SUPPORTED, fp16 (dynamic loss scaling: the gradients autograd produces are
scaled), the ZeRO-0 torch-autocast GradScaler, and engines without the methods used here.

Thread safety: the tensor hooks run on the autograd thread while the training thread waits in
``engine.backward``; everything else on the training thread.
"""

import warnings
import weakref

import torch

from rankscope import torch as rst
from rankscope.frameworks._local_grads import Unwatched

__all__ = ["attach", "SUPPORTED"]

# DeepSpeed releases whose engine API this module was written and tested against (>= first, <
# second): 0.19.8 is tested (tests/python/test_frameworks_deepspeed.py).
SUPPORTED = ((0, 16), (0, 20))

_ENGINE_METHODS = (
    "backward",
    "step",
    "zero_optimization_stage",
    "gradient_accumulation_steps",
    "fp16_enabled",
)


def _version() -> str:
    import deepspeed

    return str(getattr(deepspeed, "__version__", "unknown"))


def _version_tuple(v: str):
    parts = []
    for piece in v.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts) if len(parts) == 2 else None


def unsupported(engine) -> str:
    """Why this engine is refused ("" when it is supported): names the version and the mode."""
    version = _version()
    vt = _version_tuple(version)
    if vt is None or not (SUPPORTED[0] <= vt < SUPPORTED[1]):
        lo, hi = SUPPORTED
        return (
            f"DeepSpeed {version} is not supported (rankscope reads DeepSpeed "
            f"{lo[0]}.{lo[1]} to before {hi[0]}.{hi[1]})"
        )
    missing = [m for m in _ENGINE_METHODS if not callable(getattr(engine, m, None))]
    if missing or not hasattr(engine, "global_steps") or not hasattr(engine, "module"):
        return f"DeepSpeed {version}: the engine lacks {', '.join(missing) or 'global_steps'}"
    stage = engine.zero_optimization_stage()
    if engine.fp16_enabled():
        return (
            f"DeepSpeed {version} ZeRO-{stage} with fp16: the gradients are loss-scaled "
            "(dynamic loss scaling); use bf16 or fp32"
        )
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        return f"DeepSpeed {version} ZeRO-{stage} with torch autocast's GradScaler"
    if stage not in (0, 1, 2, 3):
        return f"DeepSpeed {version}: unknown ZeRO stage {stage}"
    return ""


class _Coordinates:
    """Stands for one parameter in rankscope's flat index: its full numel and shape (ZeRO-3 keeps
    them in ``ds_numel``/``ds_shape``, the parameter itself being an empty shard)."""

    requires_grad = True

    def __init__(self, param):
        self.shape = tuple(getattr(param, "ds_shape", None) or param.shape)
        self._numel = int(getattr(param, "ds_numel", None) or param.numel())

    def numel(self) -> int:
        return self._numel

    def data_ptr(self) -> int:
        return id(self)


class _Module:
    """What the Monitor reads of a module: the flat index (``named_parameters``, the engine's
    trainable parameters in module order, as coordinates) and the parameters to fingerprint
    (``parameters``: the real ones; empty for ZeRO-3)."""

    def __init__(self, names, coords, params, module):
        self._named = list(zip(names, coords))
        self._params = params
        self._module = module

    def named_parameters(self):
        return iter(self._named)

    def parameters(self):
        return iter(self._params)

    def register_forward_pre_hook(self, hook):
        return self._module.register_forward_pre_hook(hook)


def _integrity_unsupported(engine) -> str:
    """Why the aggregation check cannot read this engine's reduced gradient whole as the mean of
    the ranks' local gradients ("" when it can: ZeRO-0 without the exceptions below)."""
    stage = engine.zero_optimization_stage()
    if stage != 0:
        return f"ZeRO-{stage} leaves each rank only its partition of the reduced gradient"
    if callable(getattr(engine, "bfloat16_enabled", None)) and engine.bfloat16_enabled():
        return "bf16: BF16_Optimizer reduces its own float32 copies of the gradients"
    if not getattr(engine, "enable_backward_allreduce", True):
        return "the script reduces the gradients itself"
    if getattr(engine, "has_moe_layers", False):
        return "MoE: expert gradients are reduced over the expert data-parallel groups"
    if int(getattr(engine, "sequence_parallel_size", 1) or 1) != 1:
        return "sequence parallelism: another group and divisor"
    if getattr(engine, "pipeline_parallelism", False):
        return "pipeline parallelism"
    if not getattr(engine, "gradient_average", True):
        return "gradient_average is off (a sum, not the mean)"
    if not callable(getattr(engine, "is_gradient_accumulation_boundary", None)):
        return "the engine lacks is_gradient_accumulation_boundary"
    return ""


class DeepSpeedMonitor:
    """Feeds one engine's local gradients, losses and steps to a Monitor (``monitor``)."""

    def __init__(self, engine, monitor, params, coords, check_reduced=False):
        self.monitor = monitor
        self.stage = engine.zero_optimization_stage()
        self.accumulation = int(engine.gradient_accumulation_steps())
        self._engine = weakref.ref(engine)
        self._coords = coords
        # ZeRO-0's aggregation check reads each parameter's reduced .grad before the step.
        self._check_reduced = check_reduced
        self._params = params
        self._offsets = []
        offset = 0
        for c in coords:
            self._offsets.append(offset)
            offset += c.numel()
        # The step's local gradient, float32, in the flat index's order (one view a parameter);
        # zeroed after each step. One buffer makes the step one sketch call.
        self._flat = None
        self._views = []
        self._got = False
        self._losses = []
        self._handles = [p.register_hook(self._param_hook(i)) for i, p in enumerate(params)]
        self._backward = engine.backward
        self._step = engine.step
        engine.backward = self.backward
        engine.step = self.step

    def _buffer(self, device):
        if self._flat is None:
            total = sum(c.numel() for c in self._coords)
            self._flat = torch.zeros(total, dtype=torch.float32, device=device)
            offset = 0
            for c in self._coords:
                self._views.append(self._flat[offset : offset + c.numel()].view(c.shape))
                offset += c.numel()
        return self._flat

    def _param_hook(self, index: int):
        def hook(grad):
            if not self.monitor._active:
                return None
            self._buffer(grad.device)
            self._views[index].add_(grad.detach())
            self._got = True
            return None

        return hook

    def backward(self, loss, *args, **kwargs):
        # DeepSpeed divides the loss by the accumulation steps (``scale_wrt_gas``, default
        # True), unless the caller did already (the Hugging Face Trainer passes False).
        prescaled = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True) is False
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append((loss.detach().reshape(()).float(), prescaled))
        return self._backward(loss, *args, **kwargs)

    def _step_loss(self):
        """The step's loss: the mean of the micro-batch losses (computed as such when DeepSpeed
        scaled them, not as a sum of divided ones: the same rounding as the script's own mean),
        or the sum of the caller's pre-divided ones."""
        losses, self._losses = self._losses, []
        if not losses:
            return None
        raw = [v for v, prescaled in losses if not prescaled]
        given = [v for v, prescaled in losses if prescaled]
        if not given:
            return raw[0] if len(raw) == 1 else torch.stack(raw).mean()
        total = torch.stack(given).sum()
        if raw:
            total = total + torch.stack(raw).sum() / self.accumulation
        return total

    def step(self, *args, **kwargs):
        engine = self._engine()
        if engine is not None and self._check_reduced and self.monitor._active:
            self._add_reduced(engine)
        before = engine.global_steps if engine is not None else None
        out = self._step(*args, **kwargs)
        if engine is not None and engine.global_steps != before:
            self._boundary()
        return out

    def _add_reduced(self, engine) -> None:
        """On a step this rank checks, at the accumulation boundary: the reduced gradient (each
        parameter's .grad, before DeepSpeed's step clips and applies it) into the step's
        reduced sketch."""
        integrity = self.monitor._replica.integrity
        if not integrity.due:
            return
        try:
            if not engine.is_gradient_accumulation_boundary():
                return
            integrity.add_tensors(
                [None if p.grad is None else p.grad.detach() for p in self._params],
                self._offsets,
                reduction_dtype=engine.communication_data_type,
            )
        except Exception:  # monitoring must never break training; the step goes unchecked
            integrity.fail()

    def _boundary(self) -> None:
        mon = self.monitor
        if self._got:
            mon.local_gradient(self._flat, self._coords)
        mon.step(self._step_loss())
        if self._got:
            self._flat.zero_()
            self._got = False

    def close(self, timeout=None):
        for h in self._handles:
            h.remove()
        return self.monitor.close(timeout)


def attach(engine, **options):
    """Attaches rankscope to a DeepSpeed engine (``deepspeed.initialize``'s first value), before
    its first step; ``options`` are ``rankscope.torch.attach``'s. Steps are closed by the
    engine's own ``step()``: do not call ``mon.step``. Returns the Monitor (its
    ``deepspeed`` attribute is the DeepSpeedMonitor), or an ``Unwatched`` stand-in with the
    Monitor's methods, doing nothing, when the engine is refused (one RuntimeWarning says why;
    training is unaffected)."""
    existing = getattr(engine, "_rankscope_monitor", None)
    if existing is not None:  # attached already (e.g. by the zero-code launch)
        return existing
    why = unsupported(engine)
    if why:
        message = f"rankscope: {why}; this engine is not watched, training is unaffected"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return Unwatched(message, int(getattr(engine, "global_steps", 0)))
    stage = engine.zero_optimization_stage()
    names, params, seen = [], [], set()
    for name, p in engine.module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            names.append(name)
            params.append(p)
    coords = [_Coordinates(p) for p in params]
    replicas = stage < 3
    module = _Module(names, coords, list(engine.module.parameters()) if replicas else [], engine)
    group = getattr(engine, "data_parallel_group", None)
    if not replicas:
        options["fingerprints"] = False
    options.setdefault("group", rst.data_parallel_group(group))
    # Exact: ZeRO-1/2 step each partition on its one owner and all-gather the bits (copies);
    # ZeRO-0 steps every rank on the same all-reduced gradient (docs/shim.md).
    options["replica_check"] = rst.replica_check_for(options.get("replica_check"), "exact")
    mon = rst.attach_reducer(module, process_group=group, **options)
    # The reduced gradient is partitioned (ZeRO-1/2/3) or reduced in DeepSpeed's own buckets
    # (ZeRO-0): only the parameters are compared.
    mon._replica.enabled = False
    # The aggregation check: ZeRO-0's reduced gradient is whole in .grad before the step.
    mon.integrity_unsupported = _integrity_unsupported(engine)
    if mon.integrity_unsupported:
        mon._replica.integrity.disable()
    mon.framework = f"deepspeed {_version()} zero-{stage}"
    mon.deepspeed = DeepSpeedMonitor(
        engine, mon, params, coords, check_reduced=not mon.integrity_unsupported
    )
    engine._rankscope_monitor = mon
    return mon
