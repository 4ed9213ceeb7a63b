"""The installed wheel (issue 31), run by ./run test's installed-wheel stage on another Python than
the project's (RANKSCOPE_TEST_INSTALLED=1, tests/python/conftest.py): one version everywhere, the
grafted libraries the ones loaded (not the build machine's /usr/lib), grpcio and rankscope
streaming in one process, and the one-line errors of a Python without (a new enough) torch.
"""

import json
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import rankscope
from conftest import CLI_BIN, COLLECTOR_BIN, INSTALLED, wait_until

installed_only = pytest.mark.skipif(
    not INSTALLED, reason="tests the installed wheel (RANKSCOPE_TEST_INSTALLED=1, ./run test)"
)

# The libraries auditwheel grafted: <site-packages>/rankscope.libs.
WHEEL_LIBS = Path(rankscope.__file__).resolve().parent.parent / "rankscope.libs"
# The shared libraries of the C++ stack the wheel carries (auditwheel renames them
# libgrpc++-<hash>.so.1.51 and so on; the names still start like this).
GRAFTED = re.compile(r"^lib(grpc|gpr|upb|address_sorting|protobuf|absl_|cares|re2)")


def grafted_maps(paths) -> list:
    """The mapped files of `paths` that belong to the grafted C++ stack."""
    return [p for p in paths if GRAFTED.match(Path(p).name)]


def check_from_wheel(paths, who: str) -> None:
    stack = grafted_maps(paths)
    assert any(Path(p).name.startswith("libgrpc++") for p in stack), f"{who}: no libgrpc++ mapped"
    outside = [p for p in stack if Path(p).parent != WHEEL_LIBS]
    assert not outside, f"{who} loaded these from outside {WHEEL_LIBS}: {outside}"


@installed_only
def test_one_version_everywhere():
    """`rankscope --version`, `rankscope-collector --version` (through the console scripts),
    rankscope.__version__ (the extension's) and the wheel's metadata say the same."""
    version = rankscope.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert metadata.version("rankscope") == version
    for script in (CLI_BIN, COLLECTOR_BIN):
        out = subprocess.run(
            [str(script), "--version"], capture_output=True, text=True, timeout=30, check=True
        )
        assert out.stdout == f"{script.name} {version}\n"


@installed_only
def test_collector_runs_on_the_grafted_libraries(collector):
    """The console script execs the wheel's binary, which maps gRPC, protobuf and Abseil from
    the wheel's rankscope.libs, not the build machine's."""
    assert WHEEL_LIBS.is_dir(), f"{WHEEL_LIBS} missing: the wheel was not repaired"
    exe = Path(f"/proc/{collector.proc.pid}/exe").resolve()
    assert exe == Path(rankscope.__file__).resolve().parent / "_bin" / "rankscope-collector"
    with open(f"/proc/{collector.proc.pid}/maps") as f:
        maps = {ln.split()[5] for ln in f if len(ln.split()) >= 6}
    check_from_wheel(maps, "the collector")


@installed_only
@pytest.mark.parametrize("grpc_first", [True, False], ids=["grpc-first", "rankscope-first"])
def test_grpcio_and_rankscope_stream_in_one_process(collector, tmp_path, grpc_first):
    """Two gloo DDP ranks each run grpcio's echo (its own gRPC core) and rankscope's agent (the
    wheel's gRPC) at once, either loaded first: every echo comes back whole, every step's loss
    reaches the collector, and the rank's gRPC libraries are the wheel's."""
    import shim_harness
    from grpc_coexistence import worker

    steps, world = 6, 2
    job = "grpc-" + ("first" if grpc_first else "second")
    shim_harness.spawn(worker, world, collector.address, job, str(tmp_path), steps, grpc_first)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]

    def stored():
        rows = collector.rank_rows(job)
        return rows if len(rows) == steps * world else None

    rows = wait_until(stored, 30, f"{steps * world} rank rows of {job}")
    for rank, out in enumerate(ranks):
        assert out["echoes"] == [True] * steps, f"rank {rank}: a grpcio echo came back changed"
        losses = {step: loss for step, r, loss, _, _ in rows if r == rank}
        assert [losses[s] for s in range(steps)] == pytest.approx(out["losses"], rel=1e-6)
        assert any("/grpc/_cython/cygrpc" in p for p in out["maps"]), "grpcio not loaded"
        check_from_wheel(out["maps"], f"rank {rank}")


def test_import_without_torch_says_so_in_one_line():
    code = "import sys; sys.modules['torch'] = None; import rankscope.torch"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "ImportError: rankscope.torch needs PyTorch (torch >= 2.2), which this Python "
        f"({sys.executable}) does not have: pip install 'torch>=2.2'"
    )


def test_torch_older_than_the_floor_is_named():
    pytest.importorskip("torch")
    import torch

    from rankscope._requirements import check_torch_version

    check_torch_version(torch.__version__)  # the torch under test is supported
    check_torch_version("2.2.0")
    for old in ("2.1.2+cpu", "1.13.1"):
        with pytest.raises(ImportError) as e:
            check_torch_version(old)
        assert str(e.value) == (
            f"rankscope.torch needs torch >= 2.2, but this Python ({sys.executable}) has "
            f"torch {old}: pip install 'torch>=2.2'"
        )


@installed_only
def test_the_cuda_sketch_kernel_is_in_the_wheel():
    """Built where nvcc is (trainer_shim/cuda/CMakeLists.txt), the CUDA sketch kernel's fatbin is
    installed beside rankscope._cuda_sketch, which loads it from there."""
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("no nvcc here: the wheel has no CUDA sketch kernel")
    from rankscope import _cuda_sketch

    fatbin = Path(rankscope.__file__).resolve().parent / "_sketch.fatbin"
    assert Path(_cuda_sketch._FATBIN).resolve() == fatbin
    assert fatbin.read_bytes()[:4] == bytes.fromhex("50ed55ba")  # a fatbin's magic number
