"""What ``rankscope.torch`` needs of the process: PyTorch, ``TORCH_FLOOR`` or newer (the oldest
torch the shim is tested on: ./run test's installed-wheel stage). Imported first by
rankscope.torch: a missing or older torch is one ImportError line that names the versions. The
wheel declares the same floor (pyproject.toml)."""

import re
import sys

TORCH_FLOOR = (2, 2)


def _floor() -> str:
    return ".".join(map(str, TORCH_FLOOR))


def check_torch_version(version: str) -> None:
    """Raises ImportError if ``version`` (a ``torch.__version__``, e.g. ``2.1.2+cpu``) is older
    than TORCH_FLOOR."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if m is None or (int(m.group(1)), int(m.group(2))) < TORCH_FLOOR:
        raise ImportError(
            f"rankscope.torch needs torch >= {_floor()}, but this Python ({sys.executable}) has "
            f"torch {version}: pip install 'torch>={_floor()}'"
        )


def import_torch():
    """``import torch``, or one ImportError line saying that it is missing or too old."""
    try:
        import torch
    except ImportError as e:
        if e.name != "torch":
            raise  # torch is there but broken: its own error says more
        raise ImportError(
            f"rankscope.torch needs PyTorch (torch >= {_floor()}), which this Python "
            f"({sys.executable}) does not have: pip install 'torch>={_floor()}'"
        ) from None
    check_torch_version(torch.__version__)
    return torch


import_torch()
