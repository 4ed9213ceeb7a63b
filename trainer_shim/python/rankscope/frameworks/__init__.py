"""rankscope.frameworks: ``attach`` for training frameworks that are not a bare DDP model.

``rankscope.torch.attach(obj)`` hands anything that is neither a DistributedDataParallel model nor
a self-reducing trainer to ``attach`` here, which picks the framework by the object's type (by
module name: nothing is imported that the script did not import) and returns that framework's
Monitor, or raises TypeError when no framework knows the object. Each framework module checks its
version and mode and refuses what it does not support with one RuntimeWarning naming both; then
``attach`` returns None and training goes on unwatched.
"""

__all__ = ["attach", "framework_of"]


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
