"""rankscope's start-up hook: with ``RANKSCOPE_AUTO=1`` and this folder on PYTHONPATH, every
Python process attaches rankscope to the DistributedDataParallel and FSDP2 models it builds
(rankscope.auto; settings from RANKSCOPE_JOB and the other RANKSCOPE_* variables). Without the
variable it does nothing but hand over to the next ``sitecustomize`` on sys.path (Debian ships
one), which this file would otherwise hide.
"""


def _chain_next_sitecustomize():
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception:
                pass
            return


def _rankscope_auto():
    import os
    import sys

    if os.environ.get("RANKSCOPE_AUTO", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    try:
        from rankscope import auto

        auto.install_from_env()
    except Exception as e:  # never stop the process from starting
        sys.stderr.write(f"rankscope: RANKSCOPE_AUTO is set but nothing is attached: {e}\n")


_chain_next_sitecustomize()
_rankscope_auto()
del _chain_next_sitecustomize, _rankscope_auto
