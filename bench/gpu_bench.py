#!/usr/bin/env python3
"""What rankscope's GPU path costs, on a CUDA GPU, measured side by side in one run.

    PYTHONPATH=build-gpu/python python3 bench/gpu_bench.py kernels
    PYTHONPATH=build-gpu/python python3 bench/gpu_bench.py train --build-dir build-gpu

(tools/gpu/run_checks.sh runs both on the GPU machine.)

kernels  The device-to-device copy bandwidth (bytes read + bytes written per second, one large
         tensor), then the count sketch and the replica fingerprint of a large gradient, float32
         and bfloat16, with the torch-op path (torch_sketch.py, fingerprint.py) and the fused
         Triton kernels (triton_kernels.py): bytes of gradient read per second and that rate as
         a share of the copy's. Each timing is the median of CUDA-event timings after a warm-up.
         Also checks that the two paths agree: fingerprints bit for bit, sketch bins within
         float32 rounding of the float64 torch-op sums.
train    The step of a GPT-2-small-sized decoder (12 layers, d 768, 12 heads, vocab 50,257, bf16
         autocast) in one-rank DDP (NCCL), one replica per variant, stepped in a rotating order so
         every variant sees the same machine: plain, plain-2 (the noise floor), rankscope with the
         Triton kernels, rankscope with the torch ops, and in-band (the same sketch on the GPU
         plus a blocking all_gather of loss, norm and sketch and a host read every step). Prints
         the median step time (synchronized) and the median host time to issue the step (not
         synchronized: what the training thread spends while the GPU is busy).
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _events_ms(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernels(args) -> dict:
    from rankscope import DEFAULT_SKETCH_SEED
    from rankscope import fingerprint as fp
    from rankscope import triton_kernels as tk
    from rankscope.torch_sketch import TorchSketch

    dev = torch.device("cuda")
    n = args.elements
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    copy_ms = _events_ms(lambda: dst.copy_(src), args.reps)
    copy_bps = 2 * src.numel() * 4 / (copy_ms / 1e3)
    del dst
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "elements": n, "copy_ms": copy_ms, "copy_GBps": copy_bps / 1e9, "rows": []}
    print(f"device {out['device']}, torch {torch.__version__}, triton "
          f"{getattr(tk.triton, '__version__', 'absent')}; copy {copy_bps / 1e9:.0f} GB/s "
          f"(read + written, {n * 4 / 2**20:.0f} MiB)")
    print(f"{'what':<22}{'dtype':<10}{'path':<8}{'ms':>9}{'GB/s':>9}{'of copy':>9}")

    def row(what, dtype, path, ms, nbytes):
        bps = nbytes / (ms / 1e3)
        r = {"what": what, "dtype": str(dtype).replace("torch.", ""), "path": path, "ms": ms,
             "GBps": bps / 1e9, "share_of_copy": bps / copy_bps}
        out["rows"].append(r)
        print(f"{what:<22}{r['dtype']:<10}{path:<8}{ms:>9.3f}{bps / 1e9:>9.0f}"
              f"{100 * bps / copy_bps:>8.0f}%")

    dim = args.sketch_dim
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(n, device=dev) * 1e-3).to(dtype)
        nbytes = x.numel() * x.element_size()
        results = {}
        for path in ("torch", "triton"):
            if path == "triton" and tk.triton is None:
                continue
            os.environ["RANKSCOPE_GPU_KERNELS"] = path
            s = TorchSketch(dim, DEFAULT_SKETCH_SEED, dev)

            def sketch():
                s.reset()
                s.add(x, 12345)
            row("sketch", dtype, path, _events_ms(sketch, args.reps), nbytes)
            sketch()
            results[path] = (s.bins.clone(), s.sum_squares.clone())
            # A bucket-like layout: 200 segments with padding between them, shuffled offsets.
            seg = n // 200
            layout = fp.SegmentLayout(n, [i * seg for i in range(200)], [seg - 3] * 200,
                                      [(199 - i) * seg for i in range(200)])

            def sketch_segments():
                s.reset()
                s.add_segments(x, layout)
            row("sketch segments", dtype, path, _events_ms(sketch_segments, args.reps), nbytes)
            sketch_segments()
            results[path + "-sseg"] = (s.bins.clone(), s.sum_squares.clone())
            row("fingerprint fold", dtype, path,
                _events_ms(lambda: fp.fold(x, 777), args.reps), nbytes)
            results[path + "-fold"] = fp.fold(x, 777)
            row("fingerprint segments", dtype, path,
                _events_ms(lambda: fp.fold_segments(x, layout), args.reps), nbytes)
            results[path + "-seg"] = fp.fold_segments(x, layout)
        os.environ.pop("RANKSCOPE_GPU_KERNELS", None)
        if "triton" in results:
            tb, ts = results["triton"]
            rb, rs = results["torch"]
            bins_err = float((tb - rb).abs().max() / rb.abs().max())
            ss_err = float(abs(ts - rs) / rs)
            sb, sss = results["triton-sseg"]
            rsb, rss = results["torch-sseg"]
            bins_err = max(bins_err, float((sb - rsb).abs().max() / rsb.abs().max()))
            ss_err = max(ss_err, float(abs(sss - rss) / rss))
            same_fold = int(results["triton-fold"]) == int(results["torch-fold"])
            same_seg = int(results["triton-seg"]) == int(results["torch-seg"])
            out.setdefault("agreement", {})[str(dtype)] = {
                "bins_max_rel": bins_err, "sum_squares_rel": ss_err,
                "fold_identical": same_fold, "segments_identical": same_seg}
            print(f"  {dtype}: triton vs torch ops: bins max|d|/max|b| {bins_err:.2e}, "
                  f"sum of squares {ss_err:.2e}, fingerprints identical: fold {same_fold}, "
                  f"segments {same_seg}")
            if not (same_fold and same_seg and bins_err < 1e-5 and ss_err < 1e-6):
                out["failed"] = True
        del x
    return out


# ---- train ---------------------------------------------------------------------------------------

class Gpt(torch.nn.Module):
    def __init__(self, vocab=50257, d=768, heads=12, layers=12, ctx=512):
        super().__init__()
        nn = torch.nn
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1))

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_collector(build_dir: Path, tmp: Path):
    log = open(tmp / "collector.log", "w+")
    proc = subprocess.Popen([str(build_dir / "bin" / "rankscope-collector"),
                             "--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                             "--http_address=", f"--db_path={tmp / 'bench.db'}"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"serving gRPC on [0-9.]+:(\d+)", (tmp / "collector.log").read_text())
        if m:
            return proc, f"127.0.0.1:{m.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError("collector did not start: " + (tmp / "collector.log").read_text())


def train(args) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    import rankscope.torch as rst
    from rankscope import DEFAULT_SKETCH_SEED
    from rankscope.torch_sketch import TorchSketch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    proc, address = _start_collector(Path(args.build_dir).resolve(), tmp)
    variants = ["plain", "plain-2", "rankscope", "rankscope-torchops", "in-band"]
    models, opts, mons, inband = {}, {}, {}, {}
    for v in variants:
        torch.manual_seed(0)
        model = Gpt(layers=args.layers, ctx=args.ctx).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        if v.startswith("rankscope"):
            mons[v] = rst.attach(ddp, collector=address, job=f"gpu-bench-{v}",
                                 sketch_dim=args.sketch_dim)
        elif v == "in-band":
            sk = TorchSketch(args.sketch_dim, DEFAULT_SKETCH_SEED, dev)
            offsets, total = {}, 0
            for p in model.parameters():
                offsets[id(p)], total = total, total + p.numel()

            def hook(state, bucket, sk=sk, offsets=offsets):
                for p, g in zip(bucket.parameters(), bucket.gradients()):
                    sk.add(g, offsets[id(p)])
                return default_hooks.allreduce_hook(None, bucket)
            ddp.register_comm_hook(None, hook)
            inband[v] = sk
        models[v] = ddp
        opts[v] = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randint(0, 50257, (args.batch, args.ctx + 1), device=dev, generator=g)
    inp, tgt = x[:, :-1], x[:, 1:]

    def step(v):
        ddp, opt = models[v], opts[v]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = ddp(inp)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        loss.backward()
        opt.step()
        if v in mons:
            mons[v].step(loss)
        elif v == "in-band":
            sk = inband[v]
            payload = torch.cat([loss.detach().double().reshape(1),
                                 sk.sum_squares.sqrt().reshape(1), sk.bins])
            gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, payload)
            float(gathered[0][0])  # rank 0 reads the values: a host synchronization
            sk.reset()

    host, full = {v: [] for v in variants}, {v: [] for v in variants}
    for i in range(args.warmup + args.steps):
        order = variants[i % len(variants):] + variants[:i % len(variants)]
        for v in order:
            if v == "rankscope-torchops":
                os.environ["RANKSCOPE_GPU_KERNELS"] = "torch"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(v)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            os.environ.pop("RANKSCOPE_GPU_KERNELS", None)
            if i >= args.warmup:
                host[v].append(t1 - t0)
                full[v].append(t2 - t0)
    stats = {v: mons[v].close(timeout=30) for v in mons}
    proc.terminate()
    proc.wait()
    dist.destroy_process_group()
    nparams = sum(p.numel() for p in models["plain"].parameters())
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "params": nparams, "batch": args.batch, "ctx": args.ctx, "steps": args.steps,
           "step_ms": {v: 1e3 * statistics.median(full[v]) for v in variants},
           "host_ms": {v: 1e3 * statistics.median(host[v]) for v in variants}, "stats": stats}
    base = res["step_ms"]["plain"]
    print(f"{nparams / 1e6:.1f} M parameters, batch {args.batch} x {args.ctx}, bf16 autocast, "
          f"{args.steps} steps per variant, {res['device']}, torch {torch.__version__}")
    print(f"{'variant':<20}{'step ms':>9}{'vs plain':>10}{'host ms':>9}")
    for v in variants:
        print(f"{v:<20}{res['step_ms'][v]:>9.2f}{100 * (res['step_ms'][v] / base - 1):>9.1f}%"
              f"{res['host_ms'][v]:>9.2f}")
    for v, s in stats.items():
        print(f"{v}: recorded {s.get('recorded')} acked {s.get('acked')} hook errors "
              f"{s.get('shim_hook_errors', 0)} fingerprint errors "
              f"{s.get('shim_fingerprint_errors', 0)}")
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--elements", type=int, default=1 << 28)
    k.add_argument("--sketch-dim", type=int, default=1024)
    k.add_argument("--reps", type=int, default=7)
    t = sub.add_parser("train")
    t.add_argument("--build-dir", default=os.environ.get("RANKSCOPE_BUILD_DIR", "build-gpu"))
    t.add_argument("--layers", type=int, default=12)
    t.add_argument("--ctx", type=int, default=512)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--sketch-dim", type=int, default=4096)
    t.add_argument("--warmup", type=int, default=5)
    t.add_argument("--steps", type=int, default=20)
    for q in (k, t):
        q.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench.py: no CUDA device", file=sys.stderr)
        return 2
    res = kernels(args) if args.cmd == "kernels" else train(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 1 if res.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
