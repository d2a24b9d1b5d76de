"""torch.distributed's private modules and methods titan_fold uses, behind public names.

Each with a `# why:` line: no public equivalent in torch 2.13."""

from types import MethodType

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.hf_storage import _HFStorageInfo as HFStorageInfo
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

__all__ = [
    "AsyncCollectiveTensor",
    "CheckpointWrapper",
    "HFStorageInfo",
    "StridedShard",
    "checkpoint_wrapper",
    "funcol",
]

# why (the re-exports above): torch 2.13 keeps them in private modules or names:
# funcol, AsyncCollectiveTensor: the traceable collectives (torch.distributed._functional_collectives)
# CheckpointWrapper, checkpoint_wrapper: activation checkpointing of a block as a module
# HFStorageInfo: DCP's per-tensor storage record of a safetensors file (hf_storage._HFStorageInfo)
# StridedShard: FSDP's shard of a dim a model-parallel dim already splits (placement_types._StridedShard)


# why: a module wrapped by checkpoint_wrapper holds it under a private attribute
def checkpoint_wrapped(block: torch.nn.Module) -> torch.nn.Module:
    return block._checkpoint_wrapped_module


# why: torch 2.13's DeviceMesh merges dims into one (and splits one) only by its private methods
def flatten_mesh(mesh, name: str | None = None, backend_override=None):
    if name is None:
        return mesh._flatten()
    return mesh._flatten(name, backend_override)


def unflatten_mesh(mesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]):
    return mesh._unflatten(dim, sizes, names)


# why: functional collectives name their group by a string; its ProcessGroup is c10d's private lookup
def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


# why: NVSHMEM, the device-side exchange's backend, is known to torch.distributed._symmetric_memory
# only, a module a build may lack
def is_nvshmem_available() -> bool:
    try:
        from torch.distributed._symmetric_memory import is_nvshmem_available as available
    except ImportError:
        return False
    return available()


# why: symmetric memory (NVSHMEM buffers, rendezvous) lives in torch.distributed._symmetric_memory
def symmetric_memory():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


# why: torch's LR schedulers wrap an optimizer's bound `step` to see that it ran; the step of an
# optimizer whose update titan_fold runs itself is swapped for `step` bound to it
def swap_step(opt: torch.optim.Optimizer, step) -> None:
    opt.step = MethodType(step, opt)


# why: a tensor-parallel plan's own style is written as torch's ParallelStyle's abstract private
# `_apply`; titan_fold's styles (parallel/placement.py) define `apply_to`
class ParallelStyleHooks(ParallelStyle):
    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        return self.apply_to(module, device_mesh)

    def apply_to(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        raise NotImplementedError


# why: DCP's HuggingFaceStorageReader reads each tensor in its private `_process_read_request`;
# a reader that renames tensors (models/hf_qwen35.py) overrides `read_request`
class HFStorageReaderHooks(HuggingFaceStorageReader):
    def _process_read_request(self, f, req, planner) -> None:
        self.read_request(f, req, planner)

    def read_request(self, f, req, planner) -> None:
        super()._process_read_request(f, req, planner)
