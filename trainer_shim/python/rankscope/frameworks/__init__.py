"""rankscope.frameworks: the paths for training frameworks other than DDP, one module each
(``fsdp1``, ``fsdp2``, ...); ``rankscope.torch.attach`` dispatches here on the object it is given.

``path_for(obj)`` is the attach function for a framework object, or None; each takes
``(obj, attach_monitor, **attach's options)`` and returns a Monitor, or an ``Unwatched`` stand-in
(with one warning naming torch's version and the mode) where it cannot watch exactly.
"""


def path_for(obj):
    """The attach function of the framework ``obj`` belongs to, or None."""
    from rankscope.frameworks import fsdp1, fsdp2

    if fsdp2.is_fsdp2(obj):
        return fsdp2.attach_fsdp2
    if fsdp1.is_fsdp1(obj):
        return fsdp1.attach_fsdp1
    return None
