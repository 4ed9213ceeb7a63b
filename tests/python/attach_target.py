"""A DDP training job that knows nothing of rankscope (tests of `rankscope attach --pid` and of
the zero-code launch; it never imports rankscope). One process per rank:

    attach_target.py [--rank R --world W --port P] --dir D [--total N] [--accum A] [--zero]
                     [--own-hook] [--framework] [--skip-shard-at STEP] [--pace S] [--fsdp2]
                     [--fsdp1] [--megatron] [--save-grads] [--adam]

(Without --rank, torchrun's environment says who the rank is.) Trains TinyLM (tests/python/shim_harness.py) with SGD or ZeroRedundancyOptimizer on
deterministic batches. Next to each DDP step it computes the rank's exact local loss and
gradient from a reference replica and gathers them to rank 0 (collectives the test pays, the same
with or without rankscope), who writes D/expected.json at the end: per step, the ranks' losses,
gradient norms and exact mean pairwise cosine. Every rank writes D/pid.R at start, D/final.R
(a hash of its final parameters) at the end; rank 0 writes D/progress (the last finished step)
and, at the end, D/times.json (the wall time of every iteration).

Stops after --total steps, or, without it, once D/stop exists (holding a number K): rank 0 reads
it each step and every rank stops K steps after rank 0 saw it (one broadcast per step).
--skip-shard-at STEP (with --zero): rank 1 keeps its old copy of rank 0's shard after that step
(or the first step after D/skip appears), as if it had missed the shard's broadcast.
--framework: DDP is built inside a "Trainer" class, as HF Trainer or Lightning do.
--fsdp2: FSDP2 (fully_shard on a 1-D mesh, the block then the root) instead of DDP; with --accum,
only the last micro-batch reduces (set_requires_gradient_sync); --adam: Adam instead of SGD.
--fsdp1: FSDP1 (FullyShardedDataParallel, FULL_SHARD, the block its own unit) instead of DDP; with
--accum, no_sync() on all but the last micro-batch.
--megatron: megatron-core's DistributedDataParallel (all-reduce mode, grad_reduce_in_fp32, on the
CPU as framework_harness.megatron_on_cpu does), each micro-batch's loss backpropagated divided by
--accum (Megatron's schedules' scaling), finalize_model_grads ending the reduction.
--save-grads: rank 0 also writes D/grads.pt: per step, the ranks' exact losses and their full local
gradients in rankscope's flat order (for the exact statistics of shim_harness.exact_step_stats).
"""

import argparse
import copy
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shim_harness import TinyLM, batch, flat_grad, lm_loss  # noqa: E402  (no rankscope inside)


class Trainer:
    """What a framework does for the user: builds DDP (or FSDP2) and the optimizer, runs the
    steps."""

    def __init__(self, model, args):
        if args.megatron:
            from framework_harness import megatron_on_cpu

            megatron_on_cpu()
            from megatron.core import parallel_state
            from megatron.core.distributed import (
                DistributedDataParallel,
                DistributedDataParallelConfig,
            )
            from megatron.core.transformer import TransformerConfig

            parallel_state.initialize_model_parallel()
            config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
            ddp_config = DistributedDataParallelConfig(
                overlap_grad_reduce=False, grad_reduce_in_fp32=True
            )
            self.model = DistributedDataParallel(config, ddp_config, model)
            self.module = model
            self.opt = torch.optim.SGD(model.parameters(), lr=0.05)
            return
        if args.fsdp1:  # the block its own unit inside the root (the test_fsdp.py layout)
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            self.model = FSDP(
                model,
                auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
                device_id=torch.device("cpu"),
            )
            self.module = model
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
            return
        if args.fsdp2:  # FSDP2 on a 1-D mesh: the block, then the root (the test_fsdp.py layout)
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (args.world,))
            fully_shard(model.block, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
            self.module = model
            if args.adam:  # an optimizer that counts its steps in its state
                self.opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            else:
                self.opt = torch.optim.SGD(model.parameters(), lr=0.05)
            return
        self.model = nn.parallel.DistributedDataParallel(model)
        self.module = self.model.module
        if args.own_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.model.register_comm_hook(None, default_hooks.allreduce_hook)
        if args.zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.opt = ZeroRedundancyOptimizer(
                self.model.parameters(), optimizer_class=torch.optim.SGD, lr=0.05
            )
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)


def full_state(trainer, args) -> dict:
    """The model's full parameters as a plain state dict (FSDP2: its DTensors gathered; FSDP1:
    its full state dict, gathered; collectives every rank runs)."""
    if args.fsdp1:
        return trainer.model.state_dict()
    if not args.fsdp2:
        return trainer.module.state_dict()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
        for k, v in trainer.model.state_dict().items()
    }


def reference_backward(ref, loss, args) -> None:
    """The reference replica's backward. With --fsdp2, --fsdp1 or --megatron, through torch.autograd.grad, not
    torch.autograd.backward, whose calls rankscope's loss capture records: the job's own losses
    are then the only ones the step's reported loss averages (the FSDP2 tests hold it to the
    float32 mean exactly). The gradients are added into .grad as autograd would."""
    if args.megatron:  # Megatron's scaling: the local gradient is of the losses' mean
        loss = loss / args.accum
    if not (args.fsdp2 or args.fsdp1 or args.megatron):
        loss.backward()
        return
    params = [p for p in ref.parameters() if p.requires_grad]
    for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


def missed_shard_sync(opt, owner):
    """ZeroRedundancyOptimizer's parameter sync, after which this rank keeps its old copy of
    ``owner``'s shard (it takes part in every broadcast, so no rank hangs)."""
    sync = type(opt)._sync_params

    def faulty():
        old = [(p, p.detach().clone()) for p, r in opt._param_to_rank.items() if r == owner]
        sync(opt)
        with torch.no_grad():
            for p, v in old:
                p.copy_(v)

    return faulty


# Long: one end-to-end scenario read top to bottom, its phases commented in order; split, its
# processes and expectations would be handed between helpers.
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, help="default: $RANK (torchrun)")
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--total", type=int, default=0)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--zero", action="store_true")
    ap.add_argument("--own-hook", action="store_true")
    ap.add_argument("--framework", action="store_true")
    ap.add_argument("--skip-shard-at", type=int, default=-1)
    ap.add_argument("--pace", type=float, default=0.02)
    ap.add_argument("--fsdp2", action="store_true")
    ap.add_argument("--fsdp1", action="store_true")
    ap.add_argument("--megatron", action="store_true")
    ap.add_argument("--adam", action="store_true")
    ap.add_argument("--save-grads", action="store_true")
    args = ap.parse_args()
    out = Path(args.dir)
    torch.set_num_threads(1)
    if args.rank is None:  # launched by torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT
        dist.init_process_group("gloo")
        args.rank, args.world = dist.get_rank(), dist.get_world_size()
    else:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=args.world,
        )
    (out / f"pid.{args.rank}").write_text(str(os.getpid()))
    torch.manual_seed(7)
    model = TinyLM()
    ref = copy.deepcopy(model)
    trainer = Trainer(model, args)
    ddp, opt = trainer.model, trainer.opt

    expected = {}
    saved = {}  # rank 0, --save-grads: step -> (the ranks' exact losses, their local gradients)
    times = []  # rank 0: wall time of each whole iteration (what an attach pause lengthens)
    skipped = False
    stop_at = args.total if args.total else -1
    step = 0
    while stop_at < 0 or step < stop_at:
        t_iter = time.monotonic()
        ref.load_state_dict(full_state(trainer, args))
        ref.zero_grad(set_to_none=True)
        ref_losses = []
        ref_loss_tensors = []
        for micro in range(args.accum):
            rl = lm_loss(ref, *batch(args.rank, step, micro))
            reference_backward(ref, rl, args)
            ref_losses.append(float(rl))
            ref_loss_tensors.append(rl.detach())
        g = flat_grad(ref)

        opt.zero_grad(set_to_none=True)
        if args.megatron:
            ddp.zero_grad_buffer()
        for micro in range(args.accum):
            x, y = batch(args.rank, step, micro)
            if args.megatron:  # Megatron reduces once a step, in finalize_model_grads
                (lm_loss(ddp, x, y) / args.accum).backward()
            elif args.fsdp2:  # one reduction a step, of the micro-batches' sum
                ddp.set_requires_gradient_sync(micro == args.accum - 1)
                lm_loss(ddp, x, y).backward()
            elif micro < args.accum - 1:
                with ddp.no_sync():
                    lm_loss(ddp, x, y).backward()
            else:
                lm_loss(ddp, x, y).backward()
        skip = (
            args.zero
            and args.rank == 1
            and not skipped
            and (step == args.skip_shard_at or (out / "skip").exists())
        )
        if skip:  # within this step, rank 1 "misses" rank 0's broadcast of its shard
            skipped = True
            opt._sync_params = missed_shard_sync(opt, 0)
        if args.megatron:  # the reduced gradient, where Megatron's optimizers read it
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([ddp])
            for p in trainer.module.parameters():
                p.grad = p.main_grad
        opt.step()
        if args.megatron:
            for p in trainer.module.parameters():
                p.grad = None  # Megatron's backward hook adds .grad into main_grad
        opt.__dict__.pop("_sync_params", None)

        if args.save_grads:  # the step's loss as the job computes it: the mean in its dtype
            step_losses = [torch.zeros(1) for _ in range(args.world)]
            dist.all_gather(step_losses, torch.stack(ref_loss_tensors).mean().reshape(1))
        gathered = [torch.zeros_like(g) for _ in range(args.world)]
        dist.all_gather(gathered, g)
        losses = torch.zeros(args.world, dtype=torch.float64)
        dist.all_gather(
            list(losses.split(1)), torch.tensor([sum(ref_losses) / args.accum], dtype=torch.float64)
        )
        if args.rank == 0:
            units = [v / v.norm() for v in gathered]
            pairs = [(i, j) for i in range(args.world) for j in range(i + 1, args.world)]
            expected[step] = {
                "losses": [float(v) for v in losses],
                "norms": [float(v.norm()) for v in gathered],
                "cosine": sum(float(units[i] @ units[j]) for i, j in pairs) / len(pairs),
            }
            if args.save_grads:
                saved[step] = ([float(v) for v in step_losses], torch.stack(gathered))
            (out / "progress.tmp").write_text(str(step))
            os.replace(out / "progress.tmp", out / "progress")
        if not args.total:
            flag = torch.tensor([-1], dtype=torch.int64)
            if args.rank == 0 and stop_at < 0 and (out / "stop").exists():
                flag[0] = step + 1 + int((out / "stop").read_text() or 0)
            if args.rank == 0 and stop_at >= 0:
                flag[0] = stop_at
            dist.broadcast(flag, 0)
            if int(flag[0]) >= 0:
                stop_at = int(flag[0])
        step += 1
        time.sleep(args.pace)  # the job's own pace (data loading), not a test wait
        times.append(time.monotonic() - t_iter)

    digest = hashlib.sha256()
    final = full_state(trainer, args)
    for name, _ in ref.named_parameters():  # the model's own names (FSDP1 renames its module's)
        digest.update(final[name].detach().numpy().tobytes())
    (out / f"final.{args.rank}").write_text(
        json.dumps({"sha256": digest.hexdigest(), "steps": step})
    )
    if args.rank == 0:
        (out / "expected.json").write_text(json.dumps(expected))
        (out / "times.json").write_text(json.dumps(times))
        if args.save_grads:
            torch.save(saved, out / "grads.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
