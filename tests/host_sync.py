"""A check that code reads nothing from the device on the host: `no_host_sync()` raises HostSync
at every op that brings a tensor's value to the host (.item(), bool() and int() of a tensor call
aten._local_scalar_dense; .tolist() and .numpy() read CPU memory without an op, so a
TorchFunctionMode catches them) or whose output shape depends on the data (nonzero,
masked_select, boolean indexing, repeat_interleave without output_size, unique, bincount).
Code that runs under it on real tensors (forward and backward) needs nothing from the host
between its kernels, as a CUDA graph requires."""

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_DATA_DEPENDENT = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten.bincount,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.argwhere,
}


class HostSync(RuntimeError):
    """An op that needs a value from the device on the host."""


class _HostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("tolist", "numpy"):
            raise HostSync(f"Tensor.{func.__name__}(): reads the device on the host")
        return func(*args, **(kwargs or {}))


class _SyncingOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _DATA_DEPENDENT:
            raise HostSync(f"{func}: reads the device on the host")
        if packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None:
            raise HostSync(f"{func} without output_size: its size is the sum of the repeats")
        if packet in (aten.index, aten.index_put, aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()
        ):
            raise HostSync(f"{func} with a boolean mask: its size is the mask's count")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync():
    """Raises HostSync at the first op inside that syncs with the host, naming it."""
    with _HostReads(), _SyncingOps():
        yield
