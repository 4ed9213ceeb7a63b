"""The DDP communication hook (rankscope.torch): each gradient bucket is sketched *before* the
all-reduce, then handed to the default all-reduce (or the user's hook, chained); a callback on
the all-reduce's future folds the reduced bucket into the step's replica fingerprint.

Thread safety: the hook runs on the autograd thread while backward runs; the future's callback
when the collective completes, possibly on a communication thread (it only appends to lists).

CUDA graphs: a bucket reduced while its stream is being captured (``torch.cuda.graph``,
``make_graphed_callables``) is only chained, never sketched: a replay runs the captured kernels
but no Python, so rankscope's kernels would replay into step buffers it has since freed, and
nothing would read them. The monitor leaves such steps (and the replays, which reduce no bucket
it sees) unreported (``_monitor.Monitor._bucket_in_capture``)."""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class HookState:
    """What the comm hook needs: the monitor and the hook to chain to."""

    __slots__ = ("monitor", "chain", "chain_state")

    def __init__(self, monitor, chain, chain_state, process_group):
        self.monitor = monitor
        if chain is None:
            self.chain = default_hooks.allreduce_hook
            self.chain_state = process_group
        else:
            self.chain = chain
            self.chain_state = chain_state


def rankscope_comm_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: sketch the bucket's local gradient, then all-reduce it; once reduced,
    fold the reduced bucket into the step's replica fingerprint (a callback chained on the
    all-reduce's future: it runs when the collective completes, on the tensor's device)."""
    monitor = state.monitor
    if not monitor._active:
        return state.chain(state.chain_state, bucket)
    layout = None
    replica = monitor._replica
    try:
        if bucket.buffer().is_cuda and torch.cuda.is_current_stream_capturing():
            monitor._bucket_in_capture()
        else:
            monitor._add_bucket(bucket)
            if replica.wants_reduced:
                layout = replica.bucket_layout(bucket, monitor._sketcher)
    except Exception as e:  # monitoring must never break training
        monitor._hook_failed(e)
    fut = state.chain(state.chain_state, bucket)
    if layout is None:
        return fut
    return fut.then(lambda f: replica.fold_reduced(f, layout))
