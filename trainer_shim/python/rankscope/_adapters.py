"""Adapters that give ``Monitor`` the shape it reads (rankscope.torch): a model whose trainer
reduces gradients itself in the place of a DDP model (``SelfReduced``), and a flat gradient
buffer in the shape of DDP's GradBucket (``FlatBucket``), which the bucket sketcher and the replica
fingerprints read."""

import torch


class SelfReduced:
    """What Monitor needs of a DDP model, for a trainer that reduces gradients itself."""

    def __init__(self, module, process_group):
        self.module = module
        self.process_group = process_group

    def register_forward_pre_hook(self, hook):
        return self.module.register_forward_pre_hook(lambda _m, args: hook(self, args))


class FlatBucket:
    """A flat gradient buffer and the parameters it holds, back to back in ``params`` order, in
    the shape of DDP's GradBucket (what the sketcher and the replica fingerprints read)."""

    def __init__(self, index, buffer, params):
        self._index = index
        self._buffer = buffer
        self._params = list(params)
        self._grads = []
        offset = 0
        for p in self._params:
            n = p.numel()
            self._grads.append(buffer[offset : offset + n].view(p.shape))
            offset += n
        if offset != buffer.numel():
            raise ValueError(
                f"the gradient buffer has {buffer.numel()} values, its parameters {offset}"
            )

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads


def flat(gradient) -> torch.Tensor:
    """One flat buffer: the tensor itself, or the concatenation of a list of tensors."""
    if isinstance(gradient, torch.Tensor):
        return gradient.reshape(-1)
    return torch.cat([g.detach().reshape(-1) for g in gradient])
