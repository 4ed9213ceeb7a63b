"""The installed wheel's console scripts ``rankscope`` and ``rankscope-collector``: each replaces
this Python process with its binary in ``rankscope/_bin`` (pyproject.toml, ``[project.scripts]``),
arguments unchanged.

``RANKSCOPE_PYTHON`` is set to this interpreter unless already set, so the CLI's ``report`` and
``attach`` verbs run the Python the package is installed in (tools/cli/cli_config.cc), and find the
package itself beside the binary (``PythonDir``).
"""

import os
import sys


def _exec(name: str) -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", name)
    os.environ.setdefault("RANKSCOPE_PYTHON", sys.executable)
    try:
        os.execv(path, [path, *sys.argv[1:]])
    except OSError as e:  # not os.access first: it ignores capabilities (CAP_DAC_READ_SEARCH)
        sys.exit(f"{name}: cannot run {path} ({e.strerror}): is rankscope installed from a wheel?")


def rankscope() -> None:
    _exec("rankscope")


def collector() -> None:
    _exec("rankscope-collector")
