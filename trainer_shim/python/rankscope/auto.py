"""Zero-code attach for jobs started from now on: every DistributedDataParallel model the script
constructs is attached (rankscope._autoattach), every root FSDP2 module and FSDP1 root at its
first forward (rankscope._fsdp2_attach, rankscope._fsdp1_attach), and every Megatron-core DDP
model (rankscope._megatron_attach), dormant unless told otherwise, with the loss taken
from its backward calls and the step from its optimizer. Used by ``python -m rankscope.run`` and
by ``RANKSCOPE_AUTO=1`` (the package's ``sitecustomize``).

Settings come from the environment, as for ``rankscope.torch.attach``: ``RANKSCOPE_JOB``
(required), ``RANKSCOPE_COLLECTOR``, ``RANKSCOPE_DORMANT`` (default on: ``0`` reports from the
first agreed step), ``RANKSCOPE_SKETCH_DIM``, ``RANKSCOPE_SKETCH_BYTES``,
``RANKSCOPE_SKETCH_ENCODING``, ``RANKSCOPE_EVERY``, the TLS variables.
"""

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"rankscope: {name}={v!r} is not an integer") from None


def settings_from_env() -> dict:
    """(job, dormant, attach options) from the environment; ValueError names what is wrong."""
    job = os.environ.get("RANKSCOPE_JOB", "").strip()
    if not job:
        raise ValueError(
            "rankscope: no job name; set RANKSCOPE_JOB (or pass --job to python -m rankscope.run)"
        )
    dormant_env = os.environ.get("RANKSCOPE_DORMANT", "").strip().lower()
    if dormant_env and dormant_env not in _TRUE + _FALSE:
        raise ValueError(f"rankscope: RANKSCOPE_DORMANT={dormant_env!r}; use 1 or 0")
    options = {}
    if os.environ.get("RANKSCOPE_COLLECTOR"):
        options["collector"] = os.environ["RANKSCOPE_COLLECTOR"]
    for name, key in (
        ("RANKSCOPE_SKETCH_DIM", "sketch_dim"),
        ("RANKSCOPE_EVERY", "every"),
        ("RANKSCOPE_SKETCH_BYTES", "sketch_bytes"),
    ):
        v = _env_int(name)
        if v is not None:
            options[key] = v
    if os.environ.get("RANKSCOPE_SKETCH_ENCODING"):
        options["sketch_encoding"] = os.environ["RANKSCOPE_SKETCH_ENCODING"].strip()
    return {"job": job, "dormant": dormant_env not in _FALSE, "options": options}


_installed = False


def install(job: str, dormant: bool = True, options: dict | None = None):
    """Attaches every DDP model constructed from now on (exact type), at its first forward, and
    (through rankscope.frameworks.install_auto) every root FSDP2 module and framework object.
    Idempotent. Returns the process's AutoAttacher."""
    global _installed
    import torch

    from rankscope import _autoattach
    from rankscope._attachment import hand_over_when_built

    attacher = _autoattach.get_or_create(job, dormant, options or {})
    if _installed:
        return attacher
    hand_over_when_built(
        torch.nn.parallel.DistributedDataParallel, attacher, attacher.add, "a DDP model"
    )
    from rankscope import frameworks  # Hugging Face, Lightning, DeepSpeed

    frameworks.install_auto(attacher)
    _installed = True
    return attacher


def install_from_env():
    """``install`` with the environment's settings (ValueError when they are wrong)."""
    s = settings_from_env()
    return install(s["job"], s["dormant"], s["options"])
