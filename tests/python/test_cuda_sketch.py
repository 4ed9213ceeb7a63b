"""The CUDA C++ sketch kernel (trainer_shim/cuda/sketch.cu) where there is no GPU: CI compiles it
(nvcc, trainer_shim/cuda/CMakeLists.txt) and these tests check what can be checked without running
it (its bins against the torch ops are compared on a GPU: tests/python/test_gpu.py).

* The fatbin is in the build's package, with ELF code for every architecture the build compiled
  (sm_90, and sm_100 where nvcc has it).
* Its resource usage (cuobjdump -res-usage) is within the occupancy budget sketch.cu argues: no
  stack, no local memory, no static shared memory beyond the system's 1 KiB reserve, <= 64
  registers a thread, so that shared memory alone sets the blocks an SM holds: >= 3 (float32) and
  >= 4 (16-bit) blocks of 8 warps at dim 1,024, and 1 block at dim 4,096, on a 228 KiB SM.
* The loader's parameter arrays (rankscope._cuda_sketch) match the entry points' parameters in
  number and size (the fatbin's PTX).
* Its machine code (cuobjdump -sass) has the design's instructions: 16-byte global loads, no
  shared-memory atomics (the private sketches take plain loads and stores), no local loads or
  stores.
* Forcing the ``cuda`` backend without a GPU raises rankscope._backend's BackendFailed with the
  reason; opting in with RANKSCOPE_GPU_KERNELS=cuda falls back to the table's choice, warned.

The hash helpers the kernel uses are checked against sketch.h on the host by the C++ test
tests/agent/cuda_sketch_hash_test.cc.
"""

import ctypes
import math
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

from rankscope import _backend  # noqa: E402
from rankscope import _cuda_sketch  # noqa: E402
from rankscope._device_sketch import DeviceSketch  # noqa: E402

BUILD = Path(os.environ.get("RANKSCOPE_BUILD_DIR", "build")).resolve()
FATBIN = BUILD / "python" / "rankscope" / "_sketch.fatbin"
ARCHS = BUILD / "python" / "rankscope" / "_sketch.fatbin.archs"
KERNELS = tuple(name.decode() for name, _ in _cuda_sketch._KERNELS.values())
SM_SHARED = 228 * 1024  # shared memory an sm_90 / sm_100 SM has for blocks
RESERVED = 1024  # the system's shared memory a block (reported as SHARED:1024 on sm_90)
MAX_REGISTERS = 64


def _tool(name):
    """A CUDA tool: on PATH, in the toolkit, or (cuobjdump) the one Triton bundles."""
    found = shutil.which(name) or shutil.which(name, path="/usr/local/cuda/bin")
    if found is None and name == "cuobjdump":
        try:
            import triton
        except ImportError:
            return None
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        found = str(bundled) if bundled.exists() else None
    return found


def _fatbin():
    if not FATBIN.exists():
        if _tool("nvcc") is None:
            pytest.skip("no nvcc here: the CUDA sketch kernel is not built")
        pytest.fail(f"nvcc is here but the build has no {FATBIN} (./run build)")
    return FATBIN


@pytest.fixture(scope="module")
def cuobjdump():
    tool = _tool("cuobjdump")
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's bundled one)")
    return tool


def _run(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout


def test_fatbin_has_code_for_each_architecture(cuobjdump):
    fatbin = _fatbin()
    archs = ARCHS.read_text().split(";")
    archs = [a.strip() for a in archs if a.strip()]
    assert "sm_90" in archs
    listed = _run(cuobjdump, "--list-elf", str(fatbin))
    for arch in archs:
        assert re.search(rf"\.{arch}\.cubin", listed), (arch, listed)


def _usage(cuobjdump, fatbin):
    """{arch: {function: {REG: .., STACK: .., SHARED: .., LOCAL: ..}}} from -res-usage."""
    out = _run(cuobjdump, "-res-usage", str(fatbin))
    usage, arch, function = {}, None, None
    for line in out.splitlines():
        m = re.match(r"\s*arch = (sm_\d+)", line)
        if m:
            arch = m.group(1)
            usage.setdefault(arch, {})
        m = re.match(r"\s*Function (\w+):", line)
        if m:
            function = m.group(1)
        if "REG:" in line and arch and function:
            usage[arch][function] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
            function = None
    return usage


def _blocks_per_sm(dtype, dim, registers):
    """Blocks of 256 threads an SM holds: by shared memory, registers and threads."""
    shared = _cuda_sketch.shared_bytes(dtype, dim) + RESERVED
    return min(SM_SHARED // shared, 65536 // (registers * 256), 2048 // 256)


def test_resources_fit_the_occupancy_budget(cuobjdump):
    usage = _usage(cuobjdump, _fatbin())
    assert "sm_90" in usage, usage
    for arch, functions in usage.items():
        assert set(KERNELS) <= set(functions), (arch, functions)
        for name in KERNELS:
            u = functions[name]
            assert u["STACK"] == 0 and u["LOCAL"] == 0, (arch, name, u)  # no spills
            assert u["SHARED"] <= RESERVED, (arch, name, u)  # all of it dynamic
            assert u["REG"] <= MAX_REGISTERS, (arch, name, u)
            dtype = torch.float32 if name.endswith("_f32") else torch.bfloat16
            # The blocks sketch.cu claims, from its shared memory: registers do not cut them.
            claims = {1024: 3 if dtype == torch.float32 else 4, 4096: 1}
            for dim, blocks in claims.items():
                assert _blocks_per_sm(dtype, dim, u["REG"]) >= blocks, (arch, name, dim, u)
                assert _blocks_per_sm(dtype, dim, MAX_REGISTERS) >= blocks
    # The largest dims that fit a block (227 KiB opt-in), as sketch.cu states.
    assert 32 * 6240 + 32768 <= 227 * 1024 < 32 * 6272 + 32768
    assert _cuda_sketch.shared_bytes(torch.float32, 6240) <= 227 * 1024
    assert _cuda_sketch.shared_bytes(torch.bfloat16, 6752) <= 227 * 1024


def test_the_loaders_parameter_arrays_match_the_entry_points(cuobjdump):
    """rankscope._cuda_sketch builds each kernel's cuLaunchKernel parameter array once from its
    table of ctypes values: their number and sizes are the compiled entry points' (.param
    declarations of the fatbin's PTX), and each array slot points at its value."""
    ptx = _run(cuobjdump, "-ptx", str(_fatbin()))
    bits = {"u64": 8, "s64": 8, "b64": 8, "u32": 4, "s32": 4, "b32": 4}
    for name, params in _cuda_sketch._KERNELS.values():
        m = re.search(rf"\.entry {name.decode()}\(([^)]*)\)", ptx)
        assert m, name
        declared = [bits[t] for t in re.findall(r"\.param \.(\w+)", m.group(1))]
        assert declared == [ctypes.sizeof(kind) for _, kind in params], (name, declared)
        kernel = _cuda_sketch._Kernel(ctypes.c_void_p(), params)
        for slot, (pname, _) in zip(kernel.params, params):
            assert slot == ctypes.addressof(kernel.values[pname])


def test_machine_code_has_the_designs_instructions(cuobjdump):
    sass = _run(cuobjdump, "-sass", str(_fatbin()))
    ops = set(re.findall(r"\b([A-Z][A-Z0-9]*(?:\.[A-Z0-9]+)*)\s", sass))
    assert any(op.startswith("LDG") and op.endswith(".128") for op in ops), sorted(ops)
    assert any(op.startswith("STS") and op.endswith(".128") for op in ops), sorted(ops)
    assert not any(op.startswith("ATOMS") for op in ops), sorted(ops)  # no shared atomics
    assert not any(op.startswith(("LDL", "STL")) for op in ops), sorted(ops)  # no local memory


def test_forcing_cuda_on_a_cpu_tensor_raises_why():
    x = torch.ones(100)
    with _backend.forced(kernels=_backend.CUDA, strict=True):
        with pytest.raises(_backend.BackendFailed, match=r"^cuda: a cpu tensor"):
            _backend.sketch(x, 1024, native=False)
    if not torch.cuda.is_available():
        # No GPU: the module itself says why it cannot load (no driver, or no device).
        why = _cuda_sketch._device(0)
        assert isinstance(why, str) and why, why


def test_opting_in_without_a_gpu_falls_back_with_a_warning(monkeypatch):
    """RANKSCOPE_GPU_KERNELS=cuda on a tensor the kernel cannot take: the table's choice (the
    torch ops for a CPU tensor on the device path), the same sketch, one warning saying why."""
    monkeypatch.setenv("RANKSCOPE_GPU_KERNELS", "cuda")
    monkeypatch.setattr(_backend, "_CUDA_UNUSABLE", [])
    x = torch.randn(5000, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match=r"CUDA sketch kernel cannot run \(a cpu tensor"):
        assert _backend.sketch(x, 1024, native=False).backend == _backend.TORCH_OPS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        got = DeviceSketch(1024, 7, "cpu")
        got.add(x, 3)
    monkeypatch.delenv("RANKSCOPE_GPU_KERNELS")
    want = DeviceSketch(1024, 7, "cpu")
    want.add(x, 3)
    assert torch.equal(got.bins, want.bins)
    assert math.isclose(float(got.sum_squares), float(x.double().square().sum()), rel_tol=1e-12)
