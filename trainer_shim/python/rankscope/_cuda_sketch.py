"""The CUDA C++ count-sketch kernel (trainer_shim/cuda/sketch.cu, built by nvcc into
rankscope/_sketch.fatbin) loaded and launched through the CUDA driver API with ctypes: the
``cuda`` backend of rankscope._backend, OPT-IN (``RANKSCOPE_GPU_KERNELS=cuda``) until a GPU
session has measured it (docs/PERFORMANCE.md, "The GPU path on a real GPU": compiled and
resource-checked in CI, not yet run on a GPU).

Why ctypes over libcuda rather than NVRTC or torch's private ``torch.cuda._compile_kernel``: the
kernel is compiled once at build time (nvcc, with its resource usage checked by
tests/python/test_cuda_sketch.py), so nothing compiles at run time and nothing needs the NVRTC
library, CUDA_HOME or a private torch API; the driver library is present wherever torch runs on
an NVIDIA GPU. A launch is one ``cuLaunchKernel`` whose parameter array is built once per kernel
(its ctypes values are rewritten in place each launch): expected to cost a few microseconds of
host time against Triton's launcher's 5-13 (tritonbench#669); not yet measured.

Contract of ``sketch_add`` and ``sketch_add_pieces``: the same as triton_kernels.sketch_add and
sketch_add_pieces for the bins and squares they add (same bins and signs as agent/include/rankscope/sketch.h; float32 bins within rounding of
the torch-op path's float64 sums; squares exact float64), added into ONE float32 row ``bins``
[dim] and one float64 ``ss`` [1] (DeviceSketch passes row 0 of its partials). Launched on torch's
current stream of the values' device; nothing synchronizes with the host.

Which tensors it takes (``unusable`` says why not): a contiguous float32, bfloat16 or float16
CUDA tensor, dim >= 32 with the kernel's shared memory (32 dim + 16 or 32 KiB a block) within the
device's opt-in limit per block; the fatbin in this build; libcuda loading; the module loading on
the device (a GPU older than sm_90 takes the compute_90 PTX only if its driver can JIT it: it
cannot, so it fails to load, and the reason says so).

Thread safety: the module and its functions are loaded under a lock and then only read; the
per-(function, dim) grid sizes are computed on first use (two threads may both compute one, the
same value); a launch rewrites its kernel's parameter array under the lock.
"""

import ctypes
import os
import threading

import torch

from rankscope.torch_sketch import flat_contiguous

_FATBIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sketch.fatbin")
_THREADS = 256  # sketch.cu kWarps * 32
_STAGE_VALUES = 8 * 1024  # sketch.cu kWarps * kTileValues
_MIN_TILES_PER_WARP = 2  # a block's dim merge atomics against >= 2 tiles (or pieces) a warp
_MASK64 = (1 << 64) - 1

_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# Each entry point's parameters (sketch.cu): a contiguous range, and a piece table.
_RANGE = (
    ("x", ctypes.c_void_p),
    ("n", ctypes.c_longlong),
    ("offset", ctypes.c_longlong),
    ("seed", ctypes.c_ulonglong),
    ("dim", ctypes.c_uint),
    ("bins", ctypes.c_void_p),
    ("ss", ctypes.c_void_p),
)
_PIECES = (
    ("x", ctypes.c_void_p),
    ("starts", ctypes.c_void_p),
    ("counts", ctypes.c_void_p),
    ("goffs", ctypes.c_void_p),
    ("n_pieces", ctypes.c_longlong),
    ("seed", ctypes.c_ulonglong),
    ("dim", ctypes.c_uint),
    ("bins", ctypes.c_void_p),
    ("ss", ctypes.c_void_p),
)
_KERNELS = {
    (dtype, pieces): (f"rankscope_sketch_{'pieces_' if pieces else ''}{suffix}".encode(), params)
    for dtype, suffix in _SUFFIXES.items()
    for pieces, params in ((False, _RANGE), (True, _PIECES))
}

# CUDA driver API enumerators (cuda.h).
_ATTR_STATIC_SHARED = 1  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
_ATTR_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_DEV_SMS = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
_DEV_SHARED_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN

_lock = threading.Lock()
_lib = None  # libcuda, or the reason it does not load (str)
_devices = {}  # device index -> _Device, or the reason the module does not load there (str)


def shared_bytes(dtype: torch.dtype, dim: int) -> int:
    """Dynamic shared memory a block of the kernel uses: 8 private sketches of ``dim`` float32
    bins and 8 staging tiles of 1,024 values (sketch.cu)."""
    return 8 * 4 * dim + _STAGE_VALUES * torch.empty((), dtype=dtype).element_size()


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        if _lib is not None and not isinstance(_lib, str):
            _lib.cuGetErrorString(rc, ctypes.byref(name))
        raise CudaError(f"{what}: CUDA error {rc} ({(name.value or b'?').decode()})")


def _libcuda():
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            _lib = f"libcuda.so.1 does not load (no NVIDIA driver here): {e}"
            return _lib
        _lib = lib
        try:
            _check(lib.cuInit(0), "cuInit")
        except CudaError as e:
            _lib = f"the CUDA driver does not initialise: {e}"
    return _lib


class _Kernel:
    """One entry point and its parameter array, built once: ``values[name]`` is the ctypes value
    a launch rewrites, ``params`` the array of their addresses cuLaunchKernel reads."""

    def __init__(self, function, params):
        self.function = function
        self.values = {name: kind() for name, kind in params}
        self.params = (ctypes.c_void_p * len(params))(
            *(ctypes.cast(ctypes.byref(self.values[name]), ctypes.c_void_p) for name, _ in params)
        )
        self.grids = {}  # dim -> most blocks resident on the device at once
        self.max_dynamic = 0  # dynamic shared memory a block may have (set at load)


class _Device:
    def __init__(self, lib, index: int):
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), dev), "primary context")
        self._current(lib)
        value = ctypes.c_int()
        _check(lib.cuDeviceGetAttribute(ctypes.byref(value), _DEV_SMS, dev), "SM count")
        self.sms = value.value
        _check(lib.cuDeviceGetAttribute(ctypes.byref(value), _DEV_SHARED_OPTIN, dev), "shared")
        self.shared_optin = value.value
        with open(_FATBIN, "rb") as f:
            self._image = f.read()  # kept alive while the module is loaded
        self.module = ctypes.c_void_p()
        _check(lib.cuModuleLoadData(ctypes.byref(self.module), self._image), "cuModuleLoadData")
        self.kernels = {}
        for key, (name, params) in _KERNELS.items():
            function = ctypes.c_void_p()
            _check(lib.cuModuleGetFunction(ctypes.byref(function), self.module, name), name)
            kernel = _Kernel(function, params)
            # The opt-in limit less the function's static shared memory (none of its own; the
            # system's reserve, if the driver counts it there).
            _check(
                lib.cuFuncGetAttribute(ctypes.byref(value), _ATTR_STATIC_SHARED, function),
                "static shared memory",
            )
            kernel.max_dynamic = self.shared_optin - value.value
            _check(
                lib.cuFuncSetAttribute(function, _ATTR_MAX_DYNAMIC_SHARED, kernel.max_dynamic),
                "max dynamic shared memory",
            )
            self.kernels[key] = kernel

    def _current(self, lib) -> None:
        """Torch's primary context current on this thread (torch's own threads have it; a
        thread that never touched CUDA through torch may not)."""
        current = ctypes.c_void_p()
        _check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != self.context.value:
            _check(lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def grid(self, lib, kernel: _Kernel, dim: int, shared: int) -> int:
        blocks = kernel.grids.get(dim)
        if blocks is None:
            per_sm = ctypes.c_int()
            _check(
                lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(per_sm), kernel.function, _THREADS, ctypes.c_size_t(shared)
                ),
                "occupancy",
            )
            blocks = kernel.grids[dim] = max(1, per_sm.value) * self.sms
        return blocks


def _device(index: int):
    """The loaded module on device ``index``, or why it does not load (str)."""
    loaded = _devices.get(index)
    if loaded is not None:
        return loaded
    with _lock:
        loaded = _devices.get(index)
        if loaded is None:
            lib = _libcuda()
            if isinstance(lib, str):
                loaded = lib
            elif not os.path.exists(_FATBIN):
                loaded = (
                    f"no {os.path.basename(_FATBIN)} in this build of rankscope (nvcc was not "
                    "found when it was built: trainer_shim/cuda/CMakeLists.txt)"
                )
            else:
                try:
                    loaded = _Device(lib, index)
                except (CudaError, OSError) as e:
                    loaded = f"the CUDA sketch kernel does not load on device {index}: {e}"
            _devices[index] = loaded
    return loaded


def unusable(t: torch.Tensor, dim: int):
    """None if the kernel can sketch ``t`` into ``dim`` bins here, else why not (str)."""
    if not t.is_cuda:
        return f"a {t.device.type} tensor (the CUDA kernel reads CUDA tensors only)"
    if t.dtype not in _SUFFIXES:
        return f"{t.dtype} values (the kernel reads float32, bfloat16 and float16)"
    if dim < 32:
        return f"dim {dim} < 32 (a block's 32 bins wrap at most once)"
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    loaded = _device(index)
    if isinstance(loaded, str):
        return loaded
    need = shared_bytes(t.dtype, dim)
    limit = min(loaded.kernels[(t.dtype, p)].max_dynamic for p in (False, True))
    if need > limit:
        return (
            f"dim {dim} needs {need} bytes of shared memory a block, over the {limit} the "
            "device allows it"
        )
    return None


def _launch(flat: torch.Tensor, pieces: bool, dim: int, units: int, values: dict) -> None:
    """One launch of the (dtype, pieces) kernel over ``flat`` with ``values`` as its parameters
    (besides x and dim), a grid of at most the blocks resident at once and at least 2 units (tiles
    or pieces) a warp, on torch's current stream."""
    index = flat.device.index if flat.device.index is not None else torch.cuda.current_device()
    device = _device(index)
    lib = _lib
    kernel = device.kernels[(flat.dtype, pieces)]
    shared = shared_bytes(flat.dtype, dim)
    blocks = min(
        device.grid(lib, kernel, dim, shared),
        max(1, -(-units // (8 * _MIN_TILES_PER_WARP))),
    )
    stream = torch.cuda.current_stream(flat.device).cuda_stream
    with _lock:
        device._current(lib)
        kernel.values["x"].value = flat.data_ptr()
        kernel.values["dim"].value = dim
        for name, value in values.items():
            kernel.values[name].value = value
        _check(
            lib.cuLaunchKernel(
                kernel.function,
                blocks,
                1,
                1,
                _THREADS,
                1,
                1,
                shared,
                ctypes.c_void_p(stream),
                kernel.params,
                None,
            ),
            "cuLaunchKernel",
        )


def sketch_add(
    bins: torch.Tensor, ss: torch.Tensor, values: torch.Tensor, offset: int, seed: int, dim: int
) -> None:
    """Adds the flat view of ``values`` as coordinates [offset, offset + numel) into the float32
    ``bins`` [dim] and the float64 ``ss`` [>= 1] (its first element), on torch's current stream of
    the values' device, in one launch. The caller has checked ``unusable`` (None)."""
    flat = flat_contiguous(values)
    n = flat.numel()
    if n == 0:
        return
    tiles = ((offset + n - 1) // 32 - offset // 32) // 32 + 1
    _launch(
        flat,
        False,
        dim,
        tiles,
        {
            "n": n,
            "offset": offset,
            "seed": seed & _MASK64,
            "bins": bins.data_ptr(),
            "ss": ss.data_ptr(),
        },
    )


def sketch_add_pieces(
    bins: torch.Tensor, ss: torch.Tensor, flat: torch.Tensor, table, seed: int, dim: int
) -> None:
    """``sketch_add`` of the segments of the flat contiguous buffer ``flat``, given as a piece
    table (three int64 tensors on its device: start, count, global offset of each piece;
    fingerprint.SegmentLayout.pieces, triton_kernels.piece_table): one launch for a whole DDP
    bucket. The table's tensors must stay alive until the kernel has run (the layout caches
    them)."""
    starts, counts, goffs = table
    n_pieces = starts.numel()
    if n_pieces == 0:
        return
    _launch(
        flat,
        True,
        dim,
        n_pieces,
        {
            "starts": starts.data_ptr(),
            "counts": counts.data_ptr(),
            "goffs": goffs.data_ptr(),
            "n_pieces": n_pieces,
            "seed": seed & _MASK64,
            "bins": bins.data_ptr(),
            "ss": ss.data_ptr(),
        },
    )
