"""torch.ops.kvserve with its tensor arguments on the GPU, for running the kernel tests on CUDA.

Each tensor argument moves to the GPU as a view of its whole base tensor, so a strided view keeps
its strides, two views of one tensor stay aliased (a latent cache passed as both key and value),
and a write outside an `out` view shows up in the CPU base the test checks. After the op, the
arguments its schema marks as written (`Tensor!`) are copied back into their CPU bases and the
results come back to the CPU: a test written for the CPU op runs unchanged.
"""

from __future__ import annotations

import pytest
import torch


class CudaOps:
    def __init__(self, device: str = "cuda"):
        self.device = torch.device(device)

    def __getattr__(self, name: str):
        packet = getattr(torch.ops.kvserve, name)
        written = [a.alias_info is not None and a.alias_info.is_write
                   for a in packet.default._schema.arguments]

        def call(*args, **kwargs):
            bases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            moved = [self._move(a, bases) for a in args]
            moved_kwargs = {k: self._move(v, bases) for k, v in kwargs.items()}
            result = packet(*moved, **moved_kwargs)
            names = [a.name for a in packet.default._schema.arguments]
            for i, (original, on_device) in enumerate(zip(args, moved)):
                if written[i]:
                    self._copy_back(original, on_device, bases)
            for key, value in kwargs.items():
                if key in names and written[names.index(key)]:
                    self._copy_back(value, moved_kwargs[key], bases)
            return _to_cpu(result)

        return call

    def _move(self, x, bases):
        if isinstance(x, (list, tuple)):
            return type(x)(self._move(t, bases) for t in x)
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            return x
        if x.numel() == 0:  # every empty tensor's storage is at address 0: nothing to alias
            return x.to(self.device)
        base = x._base if x._base is not None else x
        if base.dtype != x.dtype or not _dense(base):
            return x.to(self.device)  # a reinterpreting view: no aliasing to keep
        key = base.untyped_storage().data_ptr()
        if key not in bases:
            bases[key] = (base, base.to(self.device))
        device_base = bases[key][1]
        return device_base.as_strided(x.size(), x.stride(),
                                      x.storage_offset() - base.storage_offset())

    def _copy_back(self, original, on_device, bases):
        if isinstance(original, (list, tuple)):
            for o, d in zip(original, on_device):
                self._copy_back(o, d, bases)
            return
        if not isinstance(original, torch.Tensor) or original.device.type != "cpu":
            return
        if original.numel() == 0:
            return
        base = original._base if original._base is not None else original
        entry = bases.get(base.untyped_storage().data_ptr())
        if entry is not None:
            entry[0].copy_(entry[1].cpu())
        else:
            original.copy_(on_device.cpu())


def host_check(*values):
    """A parametrized case the CPU op rejects from values it reads on the host (block ids, slots,
    positions): the CUDA op leaves such device metadata unread, since reading it would
    synchronise, so the case runs on the CPU only."""
    return pytest.param(*values, marks=pytest.mark.cpu_only)


def _dense(t: torch.Tensor) -> bool:
    """Contiguous: its copy on the GPU has the same strides."""
    return t.is_contiguous() and t.storage_offset() == 0


def _to_cpu(result):
    if isinstance(result, torch.Tensor):
        return result.cpu()
    if isinstance(result, (list, tuple)):
        return type(result)(_to_cpu(r) for r in result)
    return result
