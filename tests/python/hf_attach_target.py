"""A Hugging Face Trainer job (accelerate's DDP backend, gloo, CPU) that knows nothing of
rankscope, for `rankscope attach --pid` (tests/python/test_frameworks_huggingface_attach.py).
One process per rank:

    hf_attach_target.py --rank R --world W --port P --dir D [--accum A] [--fsdp2]

Trains TinyLM through transformers.Trainer with A micro-batches a step (``--fsdp2``: on
accelerate's FSDP2 backend, fsdp_version 2, with AdamW, whose step count numbers a live
attach's steps; framework_harness.fsdp_on_cpu lets accelerate build it on the CPU). Next to each step it
computes the rank's exact local loss (the mean of its micro-batch losses) and local gradient (the
sum of the gradients of loss / A) from a reference replica fed the same micro-batches, gathered
to rank 0 (collectives the test pays), who rewrites D/expected.json after every step: per
global step, the ranks' losses, gradient norms and exact mean pairwise cosine; and D/progress.
Every rank writes D/pid.R at start. Once D/stop exists (holding K), every rank stops K steps
after rank 0 saw it (one broadcast per step).
"""

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from framework_harness import (  # noqa: E402  (no rankscope inside)
    LMForTrainer,
    TokenData,
    fsdp_on_cpu,
    trainer_arguments,
    trainer_lm_state,
)
from shim_harness import flat_grad, lm_loss  # noqa: E402


# Long: one end-to-end scenario read top to bottom, its phases commented in order; split, its
# processes and expectations would be handed between helpers.
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--fsdp2", action="store_true")
    args = ap.parse_args()
    out = Path(args.dir)
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(args.rank),
        LOCAL_RANK=str(args.rank),
        WORLD_SIZE=str(args.world),
        LOCAL_WORLD_SIZE=str(args.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
    )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world
    )
    import transformers

    (out / f"pid.{args.rank}").write_text(str(os.getpid()))
    torch.manual_seed(7)
    model = LMForTrainer()
    ref = copy.deepcopy(model.lm)
    accum = args.accum
    optim = "adamw_torch" if args.fsdp2 else "sgd"
    targs = trainer_arguments(out / f"hf{args.rank}", accum, 10**6, fsdp=args.fsdp2, optim=optim)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=TokenData(n=4096))
    if args.fsdp2:
        fsdp_on_cpu(trainer)
    truth = {"losses": []}
    expected = {}
    original = trainer.training_step

    def training_step(model_, inputs, *a, **kw):
        if not truth["losses"]:  # the step's first micro-batch: the weights before its update
            ref.load_state_dict(trainer_lm_state(model_))
            ref.zero_grad(set_to_none=True)
        loss = lm_loss(ref, inputs["input_ids"], inputs["labels"])
        # torch.autograd.grad, not backward: the job's only backward calls are the Trainer's.
        params = [p for p in ref.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss / accum, params, allow_unused=True)
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        truth["losses"].append(float(loss))
        return original(model_, inputs, *a, **kw)

    trainer.training_step = training_step
    stop = {"at": -1}

    class Truth(transformers.TrainerCallback):
        def on_optimizer_step(self, a, state, control, **kwargs):
            g = flat_grad(ref)
            loss = sum(truth["losses"]) / len(truth["losses"])
            truth["losses"] = []
            gathered = [torch.zeros_like(g) for _ in range(args.world)]
            dist.all_gather(gathered, g)
            losses = torch.zeros(args.world, dtype=torch.float64)
            dist.all_gather(list(losses.split(1)), torch.tensor([loss], dtype=torch.float64))
            if args.rank == 0:
                units = [v / v.norm() for v in gathered]
                pairs = [(i, j) for i in range(args.world) for j in range(i + 1, args.world)]
                cosine = sum(float(units[i] @ units[j]) for i, j in pairs) / len(pairs)
                expected[state.global_step] = {
                    "losses": losses.tolist(),
                    "norms": [float(v.norm()) for v in gathered],
                    "cosine": cosine,
                }
                tmp = out / "expected.json.tmp"
                tmp.write_text(json.dumps(expected))
                os.replace(tmp, out / "expected.json")
                (out / "progress").write_text(str(state.global_step))

        def on_step_end(self, a, state, control, **kwargs):
            flag = torch.tensor([0], dtype=torch.int64)
            if args.rank == 0 and stop["at"] < 0 and (out / "stop").exists():
                flag[0] = state.global_step + int((out / "stop").read_text())
            dist.broadcast(flag, 0)
            if stop["at"] < 0 and int(flag) > 0:
                stop["at"] = int(flag)
            if 0 <= stop["at"] <= state.global_step:
                control.should_training_stop = True

    trainer.add_callback(Truth())
    trainer.train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
