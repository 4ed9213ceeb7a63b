#!/usr/bin/env python3
"""A small character-level transformer LM trained with DDP (gloo, CPU), watched by rankscope.

    PYTHONPATH=build/python .venv/bin/python examples/train_ddp.py --setting S1-1 --steps 100 \\
        --collector 127.0.0.1:50051 --job demo-S1-1

Four ranks (torch.multiprocessing, spawn) train on a text file Debian ships
(/usr/share/common-licenses/GPL-3), one character a token. The three settings of the paper:

  S1-1  every rank uses the same seed: the same initial weights, the same dropout stream and the
        same DistributedSampler permutation, so the ranks' shards partition the data;
  S1-2  rank 0 uses a different seed: its sampler permutation differs from the others', so its
        shard overlaps theirs (some sequences are seen twice per epoch, others never);
  S1-3  every rank its own seed: every shard is drawn from its own permutation.

(DDP broadcasts rank 0's weights at construction, so the seed's effect on the initial weights
is erased; what remains is the data each rank sees and its dropout masks. ``--skip-init-sync``
leaves the broadcast out, as a launcher bug would: then the replicas' weights differ for good.)

Every rank reports to the collector through ``rankscope.torch``; rank 0 prints a progress line.
``--no-rankscope`` trains without it. ``--dormant`` starts the shim dormant (switch it on with
``rankscope ctl enable --job J``).
"""

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

TEXT = "/usr/share/common-licenses/GPL-3"
SETTINGS = ("S1-1", "S1-2", "S1-3")
BASE_SEED = 1234


def rank_seed(setting: str, rank: int, base: int = BASE_SEED) -> int:
    if setting == "S1-1":
        return base
    if setting == "S1-2":
        return base + 1 if rank == 0 else base
    if setting == "S1-3":
        return base + 1000 * rank
    raise ValueError(f"unknown setting {setting!r} (S1-1, S1-2, S1-3)")


class CharWindows(Dataset):
    """Every window of ctx + 1 characters of the text: input is the first ctx, target the
    last ctx (next-character prediction)."""

    def __init__(self, path: str, ctx: int):
        text = open(path, encoding="utf-8").read()
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.ctx = ctx

    def __len__(self):
        return len(self.data) - self.ctx - 1

    def __getitem__(self, i):
        chunk = self.data[i : i + self.ctx + 1]
        return chunk[:-1], chunk[1:]


class CharTransformer(nn.Module):
    """A causal transformer LM: token + learned position embeddings, pre-norm encoder layers
    with a causal mask, a linear head."""

    def __init__(
        self,
        vocab: int,
        ctx: int,
        d: int = 64,
        heads: int = 4,
        layers: int = 2,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer(
            "mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False
        )

    def forward(self, x):
        t = x.shape[1]
        h = self.tok(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t])
        return self.head(self.norm(h))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, args, port: int) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size
    )
    seed = rank_seed(args.setting, rank, args.base_seed)
    torch.manual_seed(seed)
    data = CharWindows(args.text, args.ctx)
    sampler = DistributedSampler(
        data, num_replicas=args.world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = CharTransformer(len(data.vocab), args.ctx, d=args.d_model, layers=args.layers)
    # --skip-init-sync: a launcher that never broadcasts the initial weights; the replicas then
    # start from their own seeds.
    ddp = nn.parallel.DistributedDataParallel(model, init_sync=not args.skip_init_sync)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)

    mon = None
    if not args.no_rankscope:
        import rankscope.torch as rst

        mon = rst.attach(
            ddp,
            collector=args.collector,
            job=args.job,
            sketch_dim=args.sketch_dim,
            every=args.every,
            dormant=args.dormant,
            local_batch_size=args.batch_size,
        )

    step, epoch, t0 = 0, 0, time.monotonic()
    tty = sys.stderr.isatty()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            logits = ddp(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step(loss)
            step += 1
            if rank == 0 and (step % args.print_every == 0 or step == args.steps):
                rate = step / (time.monotonic() - t0)
                line = (
                    f"[{args.setting}] step {step}/{args.steps}  rank-0 loss "
                    f"{loss.item():.3f}  {rate:.1f} steps/s"
                )
                print(
                    ("\r" + line) if tty else line,
                    end="" if tty else "\n",
                    file=sys.stderr,
                    flush=True,
                )
            if step >= args.steps:
                break
        epoch += 1
    if rank == 0 and tty:
        print(file=sys.stderr)
    if mon is not None:
        stats = mon.close(timeout=30)
        if stats["acked"] != stats["recorded"]:
            print(
                f"rank {rank}: {stats['recorded'] - stats['acked']} reports not acknowledged "
                f"by the collector ({stats})",
                file=sys.stderr,
            )
    dist.destroy_process_group()


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--setting", choices=SETTINGS, default="S1-1")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--collector", default=os.environ.get("RANKSCOPE_COLLECTOR", "127.0.0.1:50051"))
    p.add_argument("--job", default=None, help="default: demo-<setting>")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--ctx", type=int, default=32, help="characters per sequence")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sketch-dim", type=int, default=1024)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--base-seed", type=int, default=BASE_SEED)
    p.add_argument(
        "--skip-init-sync",
        action="store_true",
        help="do not broadcast rank 0's initial weights (a launcher bug to detect)",
    )
    p.add_argument("--dormant", action="store_true", help="start dormant (rankscope ctl enable)")
    p.add_argument("--no-rankscope", action="store_true", help="train without the shim")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--print-every", type=int, default=5)
    p.add_argument("--text", default=TEXT)
    args = p.parse_args(argv)
    args.job = args.job or f"demo-{args.setting}"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    mp.start_processes(
        worker, args=(args, free_port()), nprocs=args.world_size, join=True, start_method="spawn"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
