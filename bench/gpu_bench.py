#!/usr/bin/env python3
"""What rankscope's GPU path costs, on a CUDA GPU, measured side by side in one run.

    python3 bench/gpu_bench.py kernels          # rankscope installed (the wheel), or
    python3 bench/gpu_bench.py train            # PYTHONPATH=build/python --collector build/bin/...

(tools/gpu/run_checks.sh runs both on the GPU machine, from the installed cp312 wheel.)

kernels  The device-to-device copy bandwidth (bytes read + bytes written per second, one large
         tensor), then the count sketch and the replica fingerprint of a large gradient, float32
         and bfloat16, with the torch-op path (torch_sketch.py, fingerprint.py) and the fused
         Triton kernels (triton_kernels.py; the sketch with atomic adds and on the tensor
         cores), and the sketch with the CUDA C++ kernel (path cuda: trainer_shim/cuda/sketch.cu
         through rankscope._cuda_sketch, opt-in in the package; FAILED with the reason where its
         fatbin or the driver does not load): bytes of gradient read per second and that rate as a share of the copy's. Each
         timing is the median of CUDA-event timings after a warm-up. Also checks that the paths
         agree: fingerprints bit for bit, sketch bins within float32 rounding of the float64
         torch-op sums.
sweep    The Triton sketch kernels' launch settings (hash blocks a tile, warps, programs a
         multiprocessor), each timed on the same gradient.

kernels and sweep run each row's backend and variant forced strictly
(rankscope._backend.forced(strict=True)): a variant that cannot run, or a kernel that raises,
gives a row that says FAILED with the reason (and the exit status 1); it is never timed as
another backend, and it does not turn Triton or the dot kernel off for the rows after it.
train    The step of a GPT-2-small-sized decoder (12 layers, d 768, 12 heads, vocab 50,257, bf16
         autocast, fused AdamW) in one-rank DDP (NCCL), one replica per variant, stepped in a
         rotating order so every variant sees the same machine: plain, plain-2 (the noise
         floor), rankscope (its default kernels), rankscope with the tensor-core sketch forced,
         with the atomic sketch forced, with the torch ops, and in-band (the same sketch on the
         GPU plus a blocking all_gather of loss, norm and sketch and a host read every step).
         Prints the median step time (synchronized) and the median host time to issue the step
         (not synchronized: what the training thread spends while the GPU is busy);
         ``--profile`` adds a cProfile of the rankscope variant's host side.
"""

import argparse
import json
import os
import re
import socket
import statistics
import shutil
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


# Long: one table, its rows in order (per dtype and k: copy, each backend and variant forced
# strictly, agreement with the torch ops), each row a few lines; a split would scatter the table.
def kernels(args) -> dict:
    from rankscope import DEFAULT_SKETCH_SEED
    from rankscope import _backend
    from rankscope import fingerprint as fp
    from rankscope import triton_kernels as tk
    from rankscope._device_sketch import DeviceSketch

    dev = torch.device("cuda")
    n = args.elements
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    copy_ms = _events_ms(lambda: dst.copy_(src), args.reps)
    copy_bps = 2 * src.numel() * 4 / (copy_ms / 1e3)
    dst = None  # frees the copy target
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "elements": n,
        "copy_ms": copy_ms,
        "copy_GBps": copy_bps / 1e9,
        "rows": [],
    }
    print(
        f"device {out['device']}, torch {torch.__version__}, triton "
        f"{getattr(tk.triton, '__version__', 'absent')}; copy {copy_bps / 1e9:.0f} GB/s "
        f"(read + written, {n * 4 / 2**20:.0f} MiB)"
    )
    print(f"{'what':<22}{'dtype':<10}{'path':<8}{'ms':>9}{'GB/s':>9}{'of copy':>9}")
    print(
        "(torch: torch ops; atomic: Triton, one atomic add a value; dot: Triton, tensor cores; "
        "cuda: CUDA C++, bins private in shared memory)"
    )

    def row(what, dtype, path, fn, nbytes, result):
        """Times ``fn`` (forced to ``path``) and keeps ``result()``; a failure is a FAILED row
        with the reason. True if it ran."""
        force = FORCE[path]
        try:
            with _backend.forced(**force):
                ms = _events_ms(fn, args.reps)
                results[(path, *result[0])] = result[1]()
        except Exception as e:  # noqa: BLE001 - reported as the row's result, and go on
            r = {
                "what": what,
                "dtype": str(dtype).replace("torch.", ""),
                "path": path,
                "failed": repr(e)[:2000],
            }
            out["rows"].append(r)
            out["failed"] = True
            print(f"{what:<22}{r['dtype']:<10}{path:<8}  FAILED: {e!r}"[:2000])
            return False
        bps = nbytes / (ms / 1e3)
        r = {
            "what": what,
            "dtype": str(dtype).replace("torch.", ""),
            "path": path,
            "ms": ms,
            "GBps": bps / 1e9,
            "share_of_copy": bps / copy_bps,
        }
        out["rows"].append(r)
        print(
            f"{what:<22}{r['dtype']:<10}{path:<8}{ms:>9.3f}{bps / 1e9:>9.0f}"
            f"{100 * bps / copy_bps:>8.0f}%"
        )

        return True

    # What each path forces (strictly: a failure is its row's, never another backend's).
    triton = {"kernels": _backend.TRITON, "strict": True}
    FORCE = {
        "torch": {"kernels": _backend.TORCH_OPS, "strict": True},
        "atomic": dict(triton, sketch=_backend.ATOMIC),
        "dot": dict(triton, sketch=_backend.DOT),
        "triton": triton,
        "cuda": {"kernels": _backend.CUDA, "strict": True},
    }
    paths = [p for p in ("torch", "atomic", "dot", "cuda") if p in args.paths]
    if tk.triton is None:
        print("Triton does not import here: the torch-op and CUDA C++ rows only")
        paths = [p for p in paths if p in ("torch", "cuda")]
    for dtype in [getattr(torch, d) for d in args.dtypes]:
        x = (torch.randn(n, device=dev) * 1e-3).to(dtype)
        nbytes = x.numel() * x.element_size()
        # A bucket-like layout: 200 segments with padding between them, shuffled offsets.
        seg = n // 200
        layout = fp.SegmentLayout(
            n, [i * seg for i in range(200)], [seg - 3] * 200, [(199 - i) * seg for i in range(200)]
        )
        results = {}
        for path in paths:
            for dim in args.sketch_dims:
                s = DeviceSketch(dim, DEFAULT_SKETCH_SEED, dev)

                def sketch(s=s):
                    s.reset()
                    s.add(x, 12345)

                def sketch_segments(s=s):
                    s.reset()
                    s.add_segments(x, layout)

                def bins(fn, s=s):
                    fn()
                    return s.bins.clone(), s.sum_squares.clone()

                row(
                    f"sketch k={dim}",
                    dtype,
                    path,
                    sketch,
                    nbytes,
                    ((dim, "whole"), lambda: bins(sketch)),
                )
                row(
                    f"sketch segs k={dim}",
                    dtype,
                    path,
                    sketch_segments,
                    nbytes,
                    ((dim, "segs"), lambda: bins(sketch_segments)),
                )
            if path in ("dot", "cuda"):
                continue  # the fingerprint kernels do not depend on the sketch variant
            fpath = "torch" if path == "torch" else "triton"
            row(
                "fingerprint fold",
                dtype,
                fpath,
                lambda: fp.fold(x, 777),
                nbytes,
                (("fold",), lambda: fp.fold(x, 777)),
            )
            row(
                "fingerprint segments",
                dtype,
                fpath,
                lambda: fp.fold_segments(x, layout),
                nbytes,
                (("seg",), lambda: fp.fold_segments(x, layout)),
            )

            # No padding here: the torch-op path's norm covers the whole buffer.
            dense = fp.SegmentLayout(
                n,
                [i * seg for i in range(200)],
                [seg] * 199 + [n - 199 * seg],
                [(199 - i) * seg for i in range(200)],
            )

            def fp_squares():
                f, q = fp.fold_segments_and_squares(x, dense)
                return f.sum(), q.sum()

            row("fingerprint+squares", dtype, fpath, fp_squares, nbytes, (("fpsq",), fp_squares))
            # A model's parameters: 150 tensors of mixed sizes, folded for a parameter check.
            sizes = [n // 300] * 50 + [n // 3000] * 50 + [n // 30000] * 50
            tensors, offsets, at = [], [], 0
            for k in sizes:
                tensors.append(x[at : at + k].clone())
                offsets.append(at)
                at += k
            cache = {}

            def many(tensors=tensors, offsets=offsets, cache=cache):
                return fp.add_all(fp.fold_many(tensors, offsets, cache), dev)

            row(
                "fingerprint 150 tensors",
                dtype,
                fpath,
                many,
                sum(sizes) * x.element_size(),
                (("many",), many),
            )
            tensors = None
        agree = out.setdefault("agreement", {}).setdefault(str(dtype), {})
        for (path, *rest), value in results.items():
            if path == "torch" or ("torch", *rest) not in results:
                continue
            ref = results[("torch", *rest)]
            key = f"{path} " + " ".join(str(r) for r in rest)
            if rest[0] == "fpsq":
                same = int(value[0]) == int(ref[0])
                rel = float(abs(value[1] - ref[1]) / ref[1])
                ok = same and rel < 1e-12
                agree[key] = {"identical": same, "sum_squares_rel": rel}
                print(f"  {dtype} {key}: fingerprint identical {same}, squares rel {rel:.1e}")
            elif rest[0] in ("fold", "seg", "many"):
                ok = int(value) == int(ref)
                agree[key] = {"identical": ok}
                print(f"  {dtype} {key}: identical to the torch ops: {ok}")
            else:
                (tb, ts), (rb, rs) = value, ref
                bins_err = float((tb - rb).abs().max() / rb.abs().max())
                ss_err = float(abs(ts - rs) / rs)
                ok = bins_err < 1e-5 and ss_err < 1e-9
                agree[key] = {"bins_max_rel": bins_err, "sum_squares_rel": ss_err}
                print(
                    f"  {dtype} {key}: bins max|d|/max|b| {bins_err:.2e}, "
                    f"sum of squares {ss_err:.2e}"
                )
            if not ok:
                out["failed"] = True
        x = None  # frees the gradient before the next dtype
    return out


def sweep(args) -> dict:
    """The sketch kernels' launch settings (tile of hash blocks, warps, programs per
    multiprocessor), each timed on the same gradient: which setting the defaults should be.

    Each row launches the kernel itself (triton_kernels.sketch_add) in the variant its path
    names, forced strictly (rankscope._backend.forced): a setting Triton cannot compile, or a dim
    the tensor-core kernel cannot take, is a FAILED row with the reason, never timed as another
    kernel, and it turns nothing off for the rows after it."""
    from rankscope import DEFAULT_SKETCH_SEED
    from rankscope import _backend
    from rankscope import triton_kernels as tk

    dev = torch.device("cuda")
    out = {"rows": []}
    print(
        f"{'path':<8}{'dtype':<10}{'k':>6}{'blocks':>8}{'warps':>7}{'x SMs':>7}{'ms':>9}{'GB/s':>8}"
    )
    for dtype in [getattr(torch, d) for d in args.dtypes]:
        x = (torch.randn(args.elements, device=dev) * 1e-3).to(dtype)
        for path in args.paths:
            force = {"kernels": _backend.TRITON, "sketch": path, "strict": True}
            for dim in args.sketch_dims:
                for blocks, warps, factor in args.configs:
                    tk._SKETCH_BLOCKS, tk._SKETCH_WARPS, tk._PROGRAM_FACTOR = blocks, warps, factor
                    rows, ss = tk.sketch_partials(dev, dim)
                    label = f"{str(dtype)[6:]:<10}{dim:>6}{blocks:>8}{warps:>7}{factor:>7}"
                    row = {
                        "path": path,
                        "dtype": str(dtype),
                        "dim": dim,
                        "blocks": blocks,
                        "warps": warps,
                        "factor": factor,
                    }
                    out["rows"].append(row)
                    try:
                        with _backend.forced(**force):
                            variant = _backend.sketch(x, dim, native=False)

                            def sketch(rows=rows, ss=ss, dim=dim, variant=variant):
                                rows.zero_()
                                ss.zero_()
                                tk.sketch_add(rows, ss, x, 12345, DEFAULT_SKETCH_SEED, dim, variant)

                            assert variant.variant == path, variant
                            ms = _events_ms(sketch, args.reps)
                    except Exception as e:  # noqa: BLE001 - a setting that cannot run: its row
                        print(f"{path:<8}{label}  FAILED: {e!r}"[:400])
                        row["failed"] = repr(e)[:400]
                        out["failed"] = True
                        continue
                    row["ms"] = ms
                    row["GBps"] = x.numel() * x.element_size() / ms / 1e6
                    print(f"{path:<8}{label}{ms:>9.3f}{row['GBps']:>8.0f}")
        x = None  # frees the gradient before the next dtype
    tk._SKETCH_BLOCKS, tk._SKETCH_WARPS, tk._PROGRAM_FACTOR = 64, None, 4
    return out


# ---- train ---------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    """A pre-norm decoder block: causal self-attention (scaled_dot_product_attention) and a
    GELU MLP."""

    def __init__(self, d, heads):
        super().__init__()
        nn = torch.nn
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.out(torch.nn.functional.gelu(self.fc(self.ln2(h))))


class Gpt(torch.nn.Module):
    """GPT-2 small's shape (12 layers, d 768, 12 heads, vocab 50,257), untied head."""

    def __init__(self, vocab=50257, d=768, heads=12, layers=12, ctx=512):
        super().__init__()
        nn = torch.nn
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_collector(collector: str, tmp: Path):
    log = open(tmp / "collector.log", "w+")
    proc = subprocess.Popen(
        [
            collector,
            "--grpc_address=127.0.0.1:0",
            "--metrics_address=127.0.0.1:0",
            "--http_address=",
            f"--db_path={tmp / 'bench.db'}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"serving gRPC on [0-9.]+:(\d+)", (tmp / "collector.log").read_text())
        if m:
            return proc, f"127.0.0.1:{m.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError("collector did not start: " + (tmp / "collector.log").read_text())


# Long: one training comparison, its variants built, stepped in a rotating order and timed in
# one place so that each sees the same device state; a split would pass the variants around.
def train(args) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    import rankscope.torch as rst
    from rankscope import DEFAULT_SKETCH_SEED
    from rankscope import _backend
    from rankscope._device_sketch import DeviceSketch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    proc, address = _start_collector(args.collector, tmp)
    variants = [
        "plain",
        "plain-2",
        "rankscope",
        "rankscope-dot",
        "rankscope-atomic",
        "rankscope-torchops",
        "in-band",
    ]
    env = {
        "rankscope-dot": {"RANKSCOPE_GPU_SKETCH": "dot"},
        "rankscope-atomic": {"RANKSCOPE_GPU_SKETCH": "atomic"},
        "rankscope-torchops": {"RANKSCOPE_GPU_KERNELS": "torch"},
    }
    models, opts, mons, inband = {}, {}, {}, {}
    for v in variants:
        torch.manual_seed(0)
        model = Gpt(layers=args.layers, ctx=args.ctx).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        if v.startswith("rankscope"):
            mons[v] = rst.attach(
                ddp, collector=address, job=f"gpu-bench-{v}", sketch_dim=args.sketch_dim
            )
        elif v == "in-band":
            sk = DeviceSketch(args.sketch_dim, DEFAULT_SKETCH_SEED, dev)
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
            payload = torch.cat(
                [loss.detach().double().reshape(1), sk.sum_squares.sqrt().reshape(1), sk.bins]
            )
            gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, payload)
            float(gathered[0][0])  # rank 0 reads the values: a host synchronization
            sk.reset()

    host, full = {v: [] for v in variants}, {v: [] for v in variants}
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
    for i in range(args.warmup + args.steps):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for v in order:
            os.environ.update(env.get(v, {}))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if profile is not None and v == "rankscope" and i >= args.warmup:
                profile.enable()
                step(v)
                profile.disable()
            else:
                step(v)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            for k in env.get(v, {}):
                os.environ.pop(k)
            if i >= args.warmup:
                host[v].append(t1 - t0)
                full[v].append(t2 - t0)
    stats = {v: mons[v].close(timeout=30) for v in mons}
    proc.terminate()
    proc.wait()
    dist.destroy_process_group()
    nparams = sum(p.numel() for p in models["plain"].parameters())
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "params": nparams,
        "batch": args.batch,
        "ctx": args.ctx,
        "steps": args.steps,
        "step_ms": {v: 1e3 * statistics.median(full[v]) for v in variants},
        "host_ms": {v: 1e3 * statistics.median(host[v]) for v in variants},
        "stats": stats,
        "triton_failed": list(_backend.TRITON_FAILED),
        "dot_failed": list(_backend.DOT_FAILED),
    }
    if res["triton_failed"] or res["dot_failed"]:
        # The variants run the shim as a trainer would (not forced strictly): a failure there
        # turned Triton (or the dot kernel) off for the process, so rows after it are not what
        # their names say.
        print(f"FAILED: a Triton kernel failed ({res['triton_failed']} {res['dot_failed']})")
        res["failed"] = True
    base = res["step_ms"]["plain"]
    print(
        f"{nparams / 1e6:.1f} M parameters, batch {args.batch} x {args.ctx}, bf16 autocast, "
        f"{args.steps} steps per variant, {res['device']}, torch {torch.__version__}"
    )
    print(f"{'variant':<20}{'step ms':>9}{'vs plain':>10}{'host ms':>9}")
    for v in variants:
        print(
            f"{v:<20}{res['step_ms'][v]:>9.2f}{100 * (res['step_ms'][v] / base - 1):>9.1f}%"
            f"{res['host_ms'][v]:>9.2f}"
        )
    if profile is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        print("host profile of the rankscope variant's timed steps (cProfile, by own time):")
        print(text.getvalue())
    for v, s in stats.items():
        print(
            f"{v}: recorded {s.get('recorded')} acked {s.get('acked')} hook errors "
            f"{s.get('shim_hook_errors', 0)} fingerprint errors "
            f"{s.get('shim_fingerprint_errors', 0)}"
        )
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--elements", type=int, default=1 << 28)
    k.add_argument(
        "--sketch-dims", type=lambda v: [int(x) for x in v.split(",")], default=[1024, 4096]
    )
    k.add_argument("--reps", type=int, default=7)
    k.add_argument(
        "--paths", type=lambda v: v.split(","), default=["torch", "atomic", "dot", "cuda"]
    )
    k.add_argument("--dtypes", type=lambda v: v.split(","), default=["float32", "bfloat16"])
    w = sub.add_parser("sweep")
    w.add_argument("--elements", type=int, default=1 << 28)
    w.add_argument("--sketch-dims", type=lambda v: [int(x) for x in v.split(",")], default=[1024])
    w.add_argument("--reps", type=int, default=5)
    w.add_argument("--paths", type=lambda v: v.split(","), default=["atomic", "dot"])
    w.add_argument("--dtypes", type=lambda v: v.split(","), default=["float32", "bfloat16"])
    w.add_argument(
        "--configs",
        default=[
            (64, 4, 4),
            (128, 4, 4),
            (64, 8, 4),
            (128, 8, 4),
            (64, 4, 2),
            (64, 4, 8),
            (32, 4, 4),
        ],
        type=lambda v: [tuple(int(x) for x in c.split(":")) for c in v.split(",")],
        help="blocks:warps:programs-per-SM,...",
    )
    t = sub.add_parser("train")
    t.add_argument(
        "--collector",
        default=shutil.which("rankscope-collector") or "build/bin/rankscope-collector",
        help="the collector binary (default: the installed wheel's on PATH, else the build's)",
    )
    t.add_argument("--layers", type=int, default=12)
    t.add_argument("--ctx", type=int, default=512)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--sketch-dim", type=int, default=4096)
    t.add_argument("--warmup", type=int, default=5)
    t.add_argument("--steps", type=int, default=20)
    t.add_argument(
        "--profile",
        action="store_true",
        help="print a cProfile of the rankscope variant's host side",
    )
    for q in (k, w, t):
        q.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench.py: no CUDA device", file=sys.stderr)
        return 2
    res = {"kernels": kernels, "sweep": sweep, "train": train}[args.cmd](args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 1 if res.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
