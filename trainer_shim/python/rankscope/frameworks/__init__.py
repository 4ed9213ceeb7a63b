"""rankscope.frameworks: the paths for training frameworks other than a bare DDP model, one
module each; ``rankscope.torch.attach`` dispatches here on the object it is given.

Two kinds of path:
- Models that reduce their own gradients (``fsdp1``, ``fsdp2``, ``megatron``): ``path_for(obj)``
  is the attach function for an FSDP1 root, an FSDP2 module or a Megatron-core DDP model, or None; each takes ``(obj, attach_monitor, **attach's options)`` and returns a
  Monitor, or an ``Unwatched`` stand-in (with one warning naming the version and the mode)
  where it cannot watch exactly.
- Frameworks that own the training loop (``deepspeed``, ``huggingface``, ``lightning``):
  ``attach(obj, **options)`` picks the framework by the object's type (by module name: nothing is
  imported that the script did not import) and returns that framework's Monitor, or raises
  TypeError when no framework knows the object. Each framework module checks its version and
  mode and refuses what it does not support with one RuntimeWarning naming both; training goes
  on unwatched (a DeepSpeed ``attach`` returns the ``Unwatched`` stand-in, as the FSDP paths do).
"""

__all__ = ["attach", "framework_of", "path_for"]


def path_for(obj):
    """The attach function of the framework ``obj`` belongs to, or None."""
    from rankscope.frameworks import fsdp1, fsdp2, megatron

    if megatron.is_megatron_ddp(obj):
        return megatron.attach_megatron
    if fsdp2.is_fsdp2(obj):
        return fsdp2.attach_fsdp2
    if fsdp1.is_fsdp1(obj):
        return fsdp1.attach_fsdp1
    return None


def framework_of(obj) -> str:
    """ "deepspeed", "huggingface", "lightning" or "" from the type of ``obj`` (its class or a
    base class living in that framework's package)."""
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module.startswith("deepspeed.") and cls.__name__ == "DeepSpeedEngine":
            return "deepspeed"
        if module.startswith("transformers.") and cls.__name__ == "Trainer":
            return "huggingface"
        if module.startswith(("lightning.", "pytorch_lightning.")) and cls.__name__ in (
            "Trainer",
            "LightningModule",
        ):
            return "lightning"
    return ""


def attach(obj, **options):
    """The framework's attach for ``obj`` (see each module); TypeError if no framework knows it."""
    name = framework_of(obj)
    if name == "deepspeed":
        from rankscope.frameworks import deepspeed

        return deepspeed.attach(obj, **options)
    if name == "huggingface":
        from rankscope.frameworks import huggingface

        return huggingface.attach(obj, **options)
    if name == "lightning":
        from rankscope.frameworks import lightning

        return lightning.attach(obj, **options)
    raise TypeError(
        "rankscope.torch.attach needs a torch.nn.parallel.DistributedDataParallel model, a "
        "DeepSpeed engine, a Hugging Face Trainer or a Lightning Trainer/LightningModule, got "
        f"{type(obj).__name__}"
    )


# ---- the zero-code launch (rankscope.auto) --------------------------------------------------

# module -> (class name, framework): the class whose __init__ the zero-code launch wraps.
_AUTO_CLASSES = {
    "transformers.trainer": ("Trainer", "huggingface"),
    "lightning.pytorch.trainer.trainer": ("Trainer", "lightning"),
    "pytorch_lightning.trainer.trainer": ("Trainer", "lightning"),
    "deepspeed.runtime.engine": ("DeepSpeedEngine", "deepspeed"),
}


def install_auto(attacher) -> None:
    """(rankscope.auto) Attaches every Hugging Face Trainer, Lightning Trainer and DeepSpeed
    engine constructed from now on, with ``attacher``'s job, dormancy and options: wraps the
    class's ``__init__`` when its module is imported (a post-import hook on ``sys.meta_path``;
    at once when it already is); and every root FSDP2 module at its first forward (FSDP2's state
    module patched the same way: rankscope._fsdp2_attach.patch_state_module), and every
    FSDP1 root at its first forward (rankscope._fsdp1_attach.patch_fsdp1_module), and every
    Megatron-core DDP model (rankscope._megatron_attach.patch_ddp_module). Never raises into the
    script: failures are warned through ``attacher.warn``."""
    import functools
    import sys

    from rankscope import _fsdp1_attach, _fsdp2_attach, _megatron_attach

    patches = {  # module -> what patches it once it is imported
        name: functools.partial(_patch_class, cls_name=cls_name, framework=framework)
        for name, (cls_name, framework) in _AUTO_CLASSES.items()
    }
    for name in _fsdp2_attach.STATE_MODULES:
        patches[name] = _fsdp2_attach.patch_state_module
    patches[_fsdp1_attach.FSDP1_MODULE] = _fsdp1_attach.patch_fsdp1_module
    patches[_megatron_attach.DDP_MODULE] = _megatron_attach.patch_ddp_module
    pending = {}
    for module_name, patch in patches.items():
        module = sys.modules.get(module_name)
        if module is not None:
            _run_patch(patch, module, attacher)
        else:
            pending[module_name] = patch
    if pending and not any(isinstance(f, _PostImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport(pending, attacher))


def _run_patch(patch, module, attacher) -> None:
    try:
        patch(module, attacher=attacher)
    except Exception as e:  # attaching must never break the script
        attacher.warn(f"rankscope: could not watch {module.__name__} ({e!r})")


def _patch_class(module, cls_name: str, framework: str, attacher) -> None:
    cls = getattr(module, cls_name, None)
    if cls is None or getattr(cls.__init__, "_rankscope", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "_rankscope_auto", False):  # a subclass's __init__ called ours
            return
        try:
            self._rankscope_auto = True
            options = dict(attacher.options, job=attacher.job, dormant=attacher.dormant)
            attach(self, **options)
        except Exception as e:  # attaching must never break the script
            attacher.warn(f"rankscope: could not attach to a {framework} {cls_name} ({e!r})")

    __init__._rankscope = True
    __init__.__wrapped__ = original
    cls.__init__ = __init__


class _PostImport:
    """A meta path finder that lets the other finders load a watched module, then patches it."""

    def __init__(self, pending: dict, attacher):
        self._pending = pending
        self._attacher = attacher

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._pending:
            return None
        import sys

        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        patch = self._pending.pop(fullname)
        spec.loader = _PatchingLoader(spec.loader, patch, self._attacher)
        return spec


class _PatchingLoader:
    def __init__(self, loader, patch, attacher):
        self._loader = loader
        self._patch = patch
        self._attacher = attacher

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _run_patch(self._patch, module, self._attacher)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def release_ddp(model) -> bool:
    """(framework callbacks) Takes ``model`` (a DDP model the framework built) away from the
    zero-code DDP attachment, which would attach it at its first forward, so that the framework's
    own attachment (with its loss and step) watches it instead. False when the DDP attachment
    already installed its monitor: then it keeps the model."""
    from rankscope import _autoattach

    attacher = _autoattach.current()
    return attacher is None or attacher.release(model)


def trainer_divides_losses(models) -> bool:
    """(rankscope._attach_payload) True when a live Hugging Face or Lightning Trainer of this
    process trains one of ``models`` (DDP models): both divide each micro-batch's loss by the
    accumulation steps before backward, so the step's loss is the sum of the backward losses.
    Reads the Trainers the garbage collector tracks (one walk, a C-level type test each)."""
    import gc
    import sys

    owners = []  # (Trainer class, how to read the model it trains)
    hf = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if isinstance(hf, type):
        owners.append((hf, lambda t: getattr(t, "model_wrapped", None)))
    for name in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        pl = getattr(sys.modules.get(name), "Trainer", None)
        if isinstance(pl, type):
            owners.append((pl, lambda t: getattr(getattr(t, "strategy", None), "model", None)))
    if not owners:
        return False
    types = tuple(cls for cls, _ in owners)
    ids = {id(m) for m in models}
    for o in gc.get_objects():
        t = type(o)
        if isinstance(t, type) and issubclass(t, types):
            for cls, model_of in owners:
                if isinstance(o, cls) and id(model_of(o)) in ids:
                    return True
    return False
