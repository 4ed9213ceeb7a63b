"""What differs between the torch versions the shim supports (2.2 and later), in one place.

``foreach_norms``: ``torch._foreach_norm`` takes ``dtype`` (the type it computes and returns in)
only from torch 2.3 on; before, the tensors are cast first (a copy of each, where 2.3 reads them
as they are)."""

import torch

_NORM_TAKES_DTYPE = None  # learned at the first call


def foreach_norms(tensors, dtype: torch.dtype) -> list:
    """The 2-norm of each tensor, computed and returned in ``dtype``."""
    global _NORM_TAKES_DTYPE
    if _NORM_TAKES_DTYPE is not False:
        try:
            norms = torch._foreach_norm(tensors, 2, dtype=dtype)
            _NORM_TAKES_DTYPE = True
            return norms
        except TypeError:  # torch 2.2: "unexpected keyword argument 'dtype'"
            if _NORM_TAKES_DTYPE:
                raise
            _NORM_TAKES_DTYPE = False
    return torch._foreach_norm([t.to(dtype) for t in tensors], 2)
