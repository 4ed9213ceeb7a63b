"""The Triton kernels of rankscope.triton_kernels, checked on the CPU with Triton's interpreter
(TRITON_INTERPRET=1: each program of a launch runs in turn, its tl operations as numpy
operations on CPU tensors), against the torch-op path CI otherwise tests (torch_sketch.py,
fingerprint.py), each kernel and variant launched as rankscope._backend would choose it. No GPU needed; test_gpu.py checks the compiled kernels on one.

Triton decides whether a kernel is compiled or interpreted when ``@triton.jit`` decorates it,
i.e. when rankscope.triton_kernels is imported, and other suites import it in this process
(rankscope.torch), compiled. So the cases live in triton_interpret_cases.py and run in a pytest
of their own, started here with TRITON_INTERPRET=1; run it by hand for one line per case:
``TRITON_INTERPRET=1 python -m pytest tests/python/triton_interpret_cases.py``.

What the cases check, each kernel and variant against the torch ops, within docs/PERFORMANCE.md's
bounds ("The GPU path on a real GPU", "Checked without a GPU, under Triton's interpreter"):

* _sketch_kernel (``sketch_add``), atomic (k = 32, 1,000, 512, 1,024, 4,096) and tensor-core
  (k = 512, 1,024, 4,096: Q = 16, 32, 128; EXACT_TF32 for float32), float32, bfloat16 and
  float16 values (and float64, atomic): several tensors into one set of per-program partial sums
  (1 value, a block boundary, 7,001 values over five tiles from an offset 17 before a tile
  boundary, none, indices past 2**37), seeds under and over 2**63. On exact data (multiples of
  1/8) the bins and the sum of squares are bit-identical to the torch ops'; on random data every
  bin is within float32 rounding of the torch ops' float64 sum ((m + 1) 2**-24 of the sum of
  |value| of its m terms; the largest difference under 1e-5 of the largest bin, gpu_bench.py's
  check) and the sum of squares within float64 summation order (2 (n + 2) 2**-53, relative).
* _sketch_pieces_kernel (``sketch_add_pieces`` with ``SegmentLayout.pieces``), both kernels, on
  a bucket-like buffer: padding, segments crossing PIECE (2,048) boundaries, offsets not
  multiples of 32, an empty segment; against DeviceSketch.add_segments' torch ops, as above.
* _fold_kernel (``fold``), _fold_pieces_kernel without and with SQUARES (``fold_pieces``: a
  bucket's segments, and a parameter check's tensors in one launch), every dtype fingerprint.py
  takes (float32, bfloat16,
  float16, float64, int32, int64, int16), with -0.0, infinities, NaN and subnormals: fingerprints
  bit-identical to the torch ops'; SQUARES' sum of squares as above.
* the shim's entry points (DeviceSketch, fold, fold_segments, fold_segments_and_squares,
  fold_many) with the kernels forced strictly for CPU tensors (_backend.forced) give what the
  torch ops give, and no call fell back to them.

What the interpreter cannot check (skipped there, with the reason): the tensor-core sketch of
bfloat16 values, since Triton 3.9's interpreter keeps bfloat16 as uint16 bits and gets -x, a
bool-to-bfloat16 cast and tl.dot of them wrong (probed at the start: the cases run once Triton
gets them right); float16 runs the same kernel code. Nor does it model the GPU's arithmetic:
tl.dot is a float32 numpy product whatever input_precision says (so tf32x3's precision is not
tested here), and programs run one after another (atomic adds never race). test_gpu.py covers
those on a GPU.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import triton  # noqa: E402,F401 - pinned in requirements.txt: a missing Triton fails, never skips

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

CASES = Path(__file__).resolve().parent / "triton_interpret_cases.py"


def test_cpu_tensors_keep_the_torch_ops():
    """In a normal process the shim never sends a CPU tensor to a Triton kernel
    (rankscope._backend: the C++ kernel, or the torch ops on the device path)."""
    from rankscope import _backend

    x = torch.zeros(4)
    assert _backend.sketch(x, 1024, native=False).backend == _backend.TORCH_OPS
    assert _backend.fingerprint(x, native=False).backend == _backend.TORCH_OPS


def test_every_kernel_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    for k in ("RANKSCOPE_GPU_KERNELS", "RANKSCOPE_GPU_SKETCH"):
        env.pop(k, None)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-12000:]
    passed = re.search(r"(\d+) passed", log)
    assert passed and int(passed.group(1)) > 0, log[-4000:]
    # The only skips: the tensor-core sketch of bfloat16 values, where the interpreter lacks
    # bfloat16 arithmetic (a skip of anything else would hide a kernel).
    skips = [line for line in log.splitlines() if line.startswith("SKIPPED")]
    assert all("bfloat16" in line for line in skips), skips
