"""``Monitor``, one rank's rankscope session (rankscope.torch; made by ``attach``): the glue over
the bucket sketcher, the replica fingerprints, the deferred device reports and the control
agreement, the step boundary (``mon.step``), the trainer-side gradient hand-over of
``attach_reducer`` (``local_gradient`` / ``reduced_gradient``), control polling and the
connection's health warnings.

Thread safety: ``Monitor`` methods are called from the training thread; the comm hook calls
``_add_bucket`` on the autograd thread while backward runs, which never overlaps ``mon.step``."""

import atexit
import collections
import functools
import math
import os
import time
import uuid
import warnings
import weakref

import torch
import torch.distributed as dist

from rankscope import _native
from rankscope import fingerprint as _fp
from rankscope._adapters import FlatBucket, flat
from rankscope._bucket_sketcher import BucketSketcher
from rankscope._buckets import DEFAULT_MAX_BUCKETS
from rankscope._control_agreement import ControlAgreement
from rankscope._deferred import DeferredReports, host_loss
from rankscope._integrity import INTEGRITY_EVERY, ReducedSketch, effective_mantissa_bits
from rankscope._options import PARAM_CHECK_EVERY
from rankscope._replica import ReplicaFingerprints


class Monitor:
    """One rank's rankscope session; made by ``attach``."""

    # Long: the monitor's state, every attribute set once here so that they are listed in one place;
    # the work is in the methods and the parts it holds.
    def __init__(
        self,
        model,
        *,
        collector,
        job,
        group="",
        sketch_dim,
        every,
        enabled,
        sketch_encoding="float32",
        sketch_threads=1,
        start_step,
        sketch_seed,
        local_batch_size,
        auth_token,
        tls_options=None,
        param_check_every=PARAM_CHECK_EVERY,
        fingerprints=True,
        integrity_every=INTEGRITY_EVERY,
        replica_check="exact",
        queue_capacity,
        max_unacked,
        warn_after,
        max_backoff,
        control_margin,
        close_timeout,
        max_buckets=DEFAULT_MAX_BUCKETS,
    ):
        pg = model.process_group
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self.global_rank = dist.get_rank()
        self.job = job
        self.group = group
        self._model_id = id(model)
        self.collector = collector
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.run_id = agree_run_id()
        self._local_batch_size = local_batch_size
        self._warn_after = warn_after
        self._close_timeout = close_timeout

        self._every = every
        self._enabled = enabled
        self._closed = False
        self._refused = False  # the collector refused this rank for good (stats()["refused"])
        self._pending_layouts = {}  # local_gradient index -> replica layout (attach_reducer)
        # What a framework path (rankscope.frameworks) names itself ("deepspeed 0.19.8 zero-2"),
        # or None.
        self.framework = None
        # An FSDP path, whose reductions can come several times a step, sets this:
        # ``reset()`` at each step start, ``close_step(sketcher)`` at mon.step, which returns
        # (report?, the step's exact sum of squares or None for the sketch's own).
        self.local_grads = None
        self._sum_squares = None  # close_step's value for the step being emitted
        self.counters = collections.Counter()
        self._warned = set()
        # A step of this monitor all-reduced a gradient bucket: a later step without one is the
        # shape of a model moved or cast after DDP wrapped it (pytorch#104336), not a setup
        # without backward.
        self._reduced_before = False
        # CUDA graphs (_ddp_hook): a bucket of this step was reduced inside a capture; since one
        # was, a step without buckets is (almost surely) a replay, which runs no Python hook.
        self._step_in_capture = False
        self._capture_seen = False
        # The four parts behind the monitor: the hook's sketching and fingerprinting, the
        # reports waiting for device copies, and the ranks' agreement on control steps. They
        # share the counters and the warned keys, and hold no reference to the monitor.
        warn_once = functools.partial(_warn_once, self._warned)
        self._replica = ReplicaFingerprints(
            model, fingerprints, param_check_every, self.counters, warn_once, replica_check
        )
        self._replica.integrity = ReducedSketch(
            sketch_dim, sketch_seed, self.rank, self.world_size, integrity_every, self.counters
        )
        self._sketcher = BucketSketcher(
            model,
            sketch_dim,
            sketch_seed,
            self.counters,
            warn_once,
            on_restart=self._replica.reset,
            threads=sketch_threads,
            max_buckets=max_buckets,
        )
        # The hello names the sketcher's parameter groups (Where in the model).
        self._agent = _native.Agent(
            collector=collector,
            job=job,
            rank=self.rank,
            world_size=self.world_size,
            sketch_dim=sketch_dim,
            sketch_seed=sketch_seed,
            attempt=self.attempt,
            framework_version=f"torch {torch.__version__}",
            auth_token=auth_token,
            queue_capacity=queue_capacity,
            max_unacked=max_unacked,
            initial_backoff_s=min(0.1, max_backoff),
            max_backoff_s=max_backoff,
            group=group,
            global_rank=self.global_rank,
            sketch_encoding=sketch_encoding,
            bucket_names=self._sketcher.bucket_names,
            run_id=self.run_id,
            **(tls_options or {}),
        )
        self.sketch_encoding = sketch_encoding
        self.instance_id = self._agent.instance_id()
        # The collector this rank streams to: `collector` itself, or the job's shard of a list.
        self.collector = self._agent.collector()
        self.sketch_threads = sketch_threads
        self.num_coordinates = self._sketcher.num_coordinates
        self._deferred = DeferredReports(self._agent, self.counters)
        self._controls = ControlAgreement(
            f"{job}/{group}" if group else job,
            self.attempt,
            self.rank,
            control_margin,
            self.counters,
            warn_once,
        )

        self._step = start_step
        self._t_attach = time.monotonic()
        self._t_step_end = None
        self._step_time_ema = None
        self._health_interval = min(1.0, max(0.05, warn_after / 2))
        self._next_health_check = self._t_attach + self._health_interval

        self._active = self._decide(self._step)
        self._replica.integrity.begin_step(self._step)
        # The step time of the first step runs from the start of its forward.
        self._forward_hook = model.register_forward_pre_hook(_forward_started(weakref.ref(self)))
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- public API -------------------------------------------------------------------------

    @property
    def step_number(self) -> int:
        """The number the next ``step()`` call will close."""
        return self._step

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def every(self) -> int:
        return self._every

    @property
    def sketch_dim(self) -> int:
        return self._sketcher.dim

    def step(self, loss=None, step: int | None = None, batch_size: int | None = None):
        """Closes one optimizer step. ``loss`` is this rank's local loss (a tensor on any
        device, or a number); ``step`` optionally gives the step's number (and renumbers the
        following ones); ``batch_size`` overrides ``local_batch_size`` for this step. Never
        blocks on I/O or on a device."""
        if self._closed:
            return
        s = self._step if step is None else int(step)
        if self._capture_seen and torch.cuda.is_current_stream_capturing():
            # Called inside the captured region: nothing here may launch, copy or query a
            # device (a replay would not run it anyway); the step is numbered and skipped.
            self.counters["steps_in_graph_capture"] += 1
            self._step_in_capture = False
            self._step = s + 1
            return
        now = time.monotonic()
        if self._active:
            if self._step_in_capture:
                self.counters["steps_in_graph_capture"] += 1  # warned by _bucket_in_capture
            elif not self._sketcher.got_grads:
                self.counters["steps_without_gradients"] += 1
                if self._capture_seen:
                    self._warn_once(
                        "nograd-graph-replay",
                        f"rankscope: mon.step() was called but no gradient bucket was "
                        f"all-reduced outside a CUDA graph since the previous step (step {s}): "
                        f"a replayed graph runs no Python hook, so its steps are not reported",
                    )
                elif self._reduced_before:
                    # The hooks fired before and no longer do: every rank now trains alone.
                    self._warn_once(
                        "nograd-after-reducing",
                        f"rankscope: mon.step() was called but no gradient bucket was "
                        f"all-reduced since the previous step, although earlier steps were "
                        f"(step {s}): DDP's hooks no longer fire and this rank trains alone. "
                        f"Was the model moved or cast (.to(), .half(), .cpu(), .cuda()) after "
                        f"DDP wrapped it (pytorch#104336)? Move or cast it before wrapping; "
                        f"nothing is reported for such steps",
                    )
                else:
                    self._warn_once(
                        "nograd",
                        "rankscope: mon.step() was called but no gradient bucket was "
                        "all-reduced since the previous step (no backward, or no_sync() on "
                        "every micro-batch?); nothing is reported for such steps",
                    )
            elif self._close_framework_step():
                self._reduced_before = True
                try:
                    self._emit(s, loss, batch_size)
                except Exception as e:  # monitoring must never break training
                    self.counters["step_errors"] += 1
                    self._warn_once(
                        "emit",
                        f"rankscope: could not report step {s} ({e!r}); training is unaffected",
                    )
        if self._t_step_end is not None:
            dt = now - self._t_step_end
            self._step_time_ema = (
                dt if self._step_time_ema is None else (0.9 * self._step_time_ema + 0.1 * dt)
            )
        self._t_step_end = now
        self._step_in_capture = False
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._step = s + 1
        self._replica.integrity.begin_step(self._step)
        if self._deferred:
            self._deferred.drain(self._after_record, block=False)
        self._poll_control()
        if now >= self._next_health_check:
            self._check_health(now)
        self._active = self._decide(self._step)
        if self._active:
            self._begin_step()

    def flush(self, timeout: float = 5.0) -> bool:
        """Hands every pending report to the agent (waiting for device copies) and waits up to
        ``timeout`` seconds until the collector acknowledged them all. True iff it did."""
        self._deferred.drain(self._after_record, block=True)
        return self._agent.flush(float(timeout)) == ""

    def close(self, timeout: float | None = None) -> dict:
        """Stops reporting (the hook stays registered, as DDP cannot remove it, and only
        forwards to the all-reduce), flushes for up to ``timeout`` seconds (default
        ``close_timeout``) and stops the agent. Idempotent. Returns the final stats."""
        if self._closed:
            return self.stats()
        self._active = False
        self._deferred.drain(self._after_record, block=True)
        self._closed = True
        err = self._agent.close(self._close_timeout if timeout is None else float(timeout))
        if err:
            self.counters["close_unacked"] += 1
        return self.stats()

    def stats(self) -> dict:
        """The agent's counters (recorded, sent, acked, rejected, dropped, invalid, reconnects,
        connected, queued, unacked), ``held_elsewhere`` (True while the collector stores nothing of
        this rank because another live run or process holds it: the agent retries), plus the
        shim's own (prefixed ``shim_``)."""
        s = self._agent.stats()
        for k, v in self.counters.items():
            s["shim_" + k] = v
        s["shim_pending_device_copies"] = len(self._deferred)
        return s

    def control(self):
        """The newest control message received (generation, apply_at_step, enabled, every,
        sketch_dim), or None."""
        return self._agent.control()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---- hook side --------------------------------------------------------------------------

    def local_gradient(self, gradient, params, index: int = 0) -> None:
        """For trainers that reduce gradients themselves (``attach_reducer``): this rank's local
        gradient of ``params`` (in that order, back to back), just before it is reduced; one flat
        buffer, or a list of tensors (then copied into one). Several buffers per step (buckets)
        are given distinct ``index`` values. Never raises for a runtime condition."""
        if not self._active:
            return
        try:
            bucket = FlatBucket(index, flat(gradient), params)
            self._add_bucket(bucket)
            if self._replica.wants_reduced:
                self._pending_layouts[index] = self._replica.bucket_layout(bucket, self._sketcher)
        except Exception as e:  # monitoring must never break training
            self._hook_failed(e)

    def reduced_gradient(self, gradient, index: int = 0) -> None:
        """The reduced (averaged) gradient of the buffer given to ``local_gradient`` with the same
        ``index``, in the same layout: folded into the step's replica fingerprint."""
        layout = self._pending_layouts.pop(index, None)
        if layout is None:
            return
        fut = torch.futures.Future()
        fut.set_result(flat(gradient))
        self._replica.fold_reduced(fut, layout)

    def _add_bucket(self, bucket) -> None:
        self._sketcher.add_bucket(bucket)

    @property
    def _cpu_sketch(self):
        """This step's sketch of the CPU gradients (a ``_native.Sketch``)."""
        return self._sketcher.cpu_sketch

    @property
    def _bypass_native(self) -> bool:
        """Tests: CPU tensors bypass the C++ kernels and are sketched and fingerprinted by the
        device path (rankscope._backend with ``native=False``: the torch ops, as a GPU without
        Triton runs them). Not RANKSCOPE_GPU_KERNELS=torch, which picks the torch ops over
        Triton for device tensors."""
        return self._sketcher.bypass_native

    @_bypass_native.setter
    def _bypass_native(self, value: bool) -> None:
        self._sketcher.bypass_native = bool(value)
        self._replica.bypass_native = bool(value)
        self._replica.integrity.bypass_native = bool(value)

    def _reset_accumulators(self) -> None:
        if self.local_grads is not None:
            self.local_grads.reset()
        self._sketcher.reset()
        self._replica.reset()
        self._pending_layouts.clear()

    def _begin_step(self) -> None:
        if self._sketcher.got_grads or self._sketcher.seen_params:
            self._reset_accumulators()

    def _bucket_in_capture(self) -> None:
        """The comm hook saw a bucket reduced while its CUDA stream is being captured into a
        graph: the step is not reported (its other buckets' sketches would be partial) and the
        hook only chained the reduction (see _ddp_hook)."""
        self.counters["graph_captured_buckets"] += 1
        self._step_in_capture = self._capture_seen = True
        self._warn_once(
            "graph-capture",
            "rankscope: a gradient bucket was all-reduced inside a CUDA graph capture "
            "(torch.cuda.graph / make_graphed_callables): rankscope does not sketch inside a "
            "captured graph (a replay runs no Python, and its kernels would write into buffers "
            "it has freed); the captured step and its replays are not reported, steps run "
            "eagerly are. Training is unaffected.",
        )

    def _hook_failed(self, e: Exception) -> None:
        self.counters["hook_errors"] += 1
        self._warn_once(
            "hook",
            f"rankscope: the comm hook failed ({e!r}); this step is not "
            "reported. Training is unaffected.",
        )
        self._sketcher.got_grads = False

    # ---- step side --------------------------------------------------------------------------

    def _decide(self, step: int) -> bool:
        return self._enabled and not self._closed and not self._refused and step % self._every == 0

    def _close_framework_step(self) -> bool:
        """Asks the framework path (if any) whether the step is reported and for its exact sum
        of squares; a failure drops the step (counted, warned), never training."""
        self._sum_squares = None
        if self.local_grads is None:
            return True
        try:
            report, self._sum_squares = self.local_grads.close_step(self._sketcher)
            return report
        except Exception as e:  # monitoring must never break training
            self._hook_failed(e)
            return False

    def _step_time(self):
        t_first_hook = self._sketcher.t_first_hook
        if t_first_hook is None or self._t_step_end is None:
            return None
        return max(0.0, t_first_hook - self._t_step_end)

    def _emit(self, step: int, loss, batch_size) -> None:
        batch = self._local_batch_size if batch_size is None else int(batch_size)
        step_time = self._step_time()
        loss_on_device = isinstance(loss, torch.Tensor) and loss.device.type != "cpu"
        sketcher = self._sketcher
        reduced = self._replica.integrity.take()  # the aggregation check's, or None
        on_host = reduced is None or reduced.device is None
        if not sketcher.device_sketches and not loss_on_device and on_host:
            grad_fp, param_fp, reduced_ss = self._replica.step_values(step, torch.device("cpu"))
            ss = (
                sketcher.cpu_sketch.sum_squares()
                if self._sum_squares is None
                else self._sum_squares
            )
            gn = math.sqrt(max(float(ss), 0.0))
            err = self._agent.record_sketch(
                step,
                host_loss(loss),
                gn,
                sketcher.cpu_sketch,
                step_time,
                batch,
                reduced_grad_fingerprint=None if grad_fp is None else _fp.to_uint64(grad_fp),
                param_fingerprint=None if param_fp is None else _fp.to_uint64(param_fp),
                replica_set=None if param_fp is None else self._replica.replica_set,
                reduced_grad_norm=None
                if reduced_ss is None
                else math.sqrt(max(float(reduced_ss), 0.0)),
                loss_absent=loss is None,
                bucket_norms=sketcher.bucket_norms(),
                reduced_sketch=None if reduced is None else reduced.cpu,
                reduced_grad_mantissa_bits=0 if reduced is None else reduced.bits,
                **self._summary_args(grad_fp, param_fp),
            )
            self._after_record(err)
            return
        self._emit_device(step, loss, step_time, batch, reduced)

    def _summary_args(self, grad_fp, param_fp) -> dict:
        """The record call's float summaries (the tolerance replica check) of the fingerprints
        this step carries."""
        args = {}
        grad, param = self._replica.grad_summary, self._replica.param_summary
        if grad_fp is not None and grad is not None:
            args["reduced_grad_projections"] = grad[0]
            args["reduced_grad_rounding"] = grad[1]
            args["reduced_grad_precision"] = grad[2]
        if param_fp is not None and param is not None:
            args["param_projections"] = param[0]
            args["param_rounding"] = param[1]
        return args

    def _emit_device(self, step, loss, step_time, batch, reduced=None) -> None:
        sketcher = self._sketcher
        # One device holds the gradient (DDP replicates a module on one device per process).
        device = next(iter(sketcher.device_sketches), None)
        if self._sum_squares is not None and device is not None:
            # The framework's exact value (a 0-d tensor on the device) replaces the sketch's
            # sum of squares of the step's reductions.
            sketcher.device_sketches[device].sum_squares.copy_(self._sum_squares)
        if device is None:  # the loss, or the reduced sketch, is what lies on a device
            on_device = reduced is not None and reduced.device is not None
            device = reduced.device.device if on_device else loss.device
        if reduced is not None:
            # Sketches summed in float32 partial bins (Triton) round more than the reduction's
            # dtype says: the precision sent covers both (rankscope._integrity).
            sketches = list(sketcher.device_sketches.values())
            if reduced.device is not None:
                sketches.append(reduced.device)
            terms = max([s.float32_terms for s in sketches], default=0)
            value_bits = min([s.value_bits for s in sketches if s.value_bits], default=0)
            reduced = reduced._replace(
                bits=effective_mantissa_bits(reduced.bits, terms, value_bits)
            )
        self._deferred.add(
            step,
            device,
            sketcher.device_sketches.get(device),
            sketcher.dim,
            sketcher.cpu_sketch,
            loss,
            lambda: self._replica.step_values(step, device),
            step_time,
            batch,
            self._after_record,
            bucket_sq=sketcher.bucket_sq(device),
            reduced=reduced,
            replica_set=self._replica.replica_set,
        )

    def _after_record(self, err: str) -> None:
        if not err:
            self.counters["reported"] += 1
            return
        self.counters["record_errors"] += 1
        self._warn_once("record", f"rankscope: the agent refused a report: {err}")

    def _start_at(self, step: int, enabled: bool) -> None:
        """(rankscope._autoattach) Numbers the step about to start ``step`` and switches the
        monitor on or leaves it dormant: called at the forward of the step every rank of the group
        agreed to start at, so that step numbers and the first reported step match across ranks."""
        self._step = int(step)
        self._replica.integrity.begin_step(self._step)
        self._enabled = bool(enabled)
        self._active = self._decide(self._step)
        if self._active:
            self._begin_step()

    # ---- control ------------------------------------------------------------------------------

    def _poll_control(self) -> None:
        due = self._controls.poll(self._agent.control(), self._step, self._step_time_ema)
        if due is not None:
            enabled, every, dim = due
            self._enabled = enabled
            self._every = every
            if dim and dim != self._sketcher.dim:
                self._sketcher.set_dim(dim)
                self._replica.integrity.set_dim(dim)
            self.counters["controls_applied"] += 1

    # ---- health -------------------------------------------------------------------------------

    def _check_health(self, now: float) -> None:
        self._next_health_check = now + self._health_interval
        s = self._agent.stats()
        if s.get("refused"):
            self._warn_once(
                "refused",
                f"rankscope: the collector at {self.collector} refused "
                f"job {self.job} group {self.group!r} rank {self.rank} for good "
                f"({s['last_error']}); this rank stops reporting, training "
                "continues",
            )
            self._active = False
            self._refused = True
            return
        if now - self._t_attach < self._warn_after:
            return
        if s.get("held_elsewhere"):
            return  # the agent said so on stderr; stats()["held_elsewhere"] says it still
        if not s["connected"]:
            why = f" ({s['last_error']})" if s.get("last_error") else ""
            self._warn_once(
                "down",
                f"rankscope: no connection to the collector at "
                f"{self.collector} for job {self.job} (rank {self.rank}){why}; "
                "training continues, reports are buffered and dropped when "
                "buffers fill",
            )
        if s["dropped"]:
            self._warn_once(
                "dropped",
                f"rankscope: {s['dropped']} reports dropped so far "
                "(collector unreachable longer than the buffers last)",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


_RUN_ID_KEY = "rankscope/run_id"


def agree_run_id() -> str:
    """The id of this launch of the job (Hello.run_id), the same on every rank of it and different
    for another launch, so that the collector tells two live runs under one job name apart (a
    collision, refused) from a restart. ``RANKSCOPE_RUN_ID`` names it explicitly; otherwise the
    first rank to ask stores a random id in the default process group's store (one
    compare-and-set, never a collective, made once at attach) and every rank reads that. Where
    no store is reachable: the launcher's rendezvous (MASTER_ADDR:MASTER_PORT and
    TORCHELASTIC_RUN_ID), or "" (unknown: the collector then tells runs apart per rank only)."""
    explicit = os.environ.get("RANKSCOPE_RUN_ID", "")
    if explicit:
        return explicit[:128]
    try:
        store = dist.distributed_c10d._get_default_store()
        agreed = store.compare_set(_RUN_ID_KEY, "", uuid.uuid4().hex)
        return bytes(agreed).decode("ascii", "replace")[:128]
    except Exception:  # no default group, or a store without compare_set: the fallback below
        pass
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not port:
        return ""
    return f"{addr}:{port}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"[:128]


def _warn_once(warned: set, key: str, message: str) -> None:
    """Monitor._warn_once for the monitor's parts: ``warned`` is the monitor's set of keys."""
    if key in warned:
        return
    warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _forward_started(ref):
    """A forward pre-hook: the first step's time runs from the start of its forward (later
    steps' from the end of the previous mon.step)."""

    def hook(module, inputs):
        monitor = ref()
        if monitor is not None and monitor._t_step_end is None:
            monitor._t_step_end = time.monotonic()
        return None

    return hook


def _close_at_exit(ref) -> None:
    monitor = ref()
    if monitor is not None:
        try:
            monitor.close()
        except Exception:
            pass
