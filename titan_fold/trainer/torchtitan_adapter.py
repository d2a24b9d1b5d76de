"""The one place titan_fold changes what torchtitan 0.2.2's code calls, and why.

torchtitan's Trainer and MetricsProcessor look these names up in their modules' globals at
call time; torchtitan offers no instance attribute or method to override in their place:

    name (module global)              read by                        overridden because
    utils.device_type, device_module  Trainer.__init__               decided at import: "cuda" on a machine
                                                                     without a GPU (self.device, to_empty)
    device_type                       dist_utils.init_distributed    the backend: nccl without a GPU
    dist_utils.maybe_enable_amp       Trainer.__init__               it computes tp or pp layouts without
                                                                     data parallelism in fp32
    CheckpointManager                 Trainer.__init__               FoldCheckpointManager (checkpoint/manager.py):
                                                                     shapes checked before a load, RNG state
    dist_utils.set_pg_timeouts        Trainer.train                  its barrier passes a CUDA device id
    build_device_memory_monitor       MetricsProcessor.__init__      a CUDA-only monitor
    time.sleep                        Trainer.train                  its 2 s wait "for other ranks" at the end;
                                                                     main waits at a barrier instead

Nothing is assigned to a torchtitan module: `with_names(function, **names)` is a copy of a
torchtitan function whose global names see `names` first, and the subclasses call these
copies where they would call the inherited method. Each trainer makes its own: two trainers
in one process share nothing, and torchtitan's own classes stay as they are.
"""

import contextlib
import inspect
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils as tt_utils

from titan_fold.checkpoint.manager import FoldCheckpointManager
from titan_fold.common.device import device_type


def with_names(function: types.FunctionType, **names) -> types.FunctionType:
    """A copy of `function` whose global lookups find `names` first (its module is untouched).
    Decorators (torchtitan's `@record`) are looked through: the copy is of the function itself."""
    function = inspect.unwrap(function)
    copy = types.FunctionType(
        function.__code__,
        {**function.__globals__, **names},
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


class Names:
    """A torchtitan module as the copies see it: these attributes, the module's for the rest."""

    def __init__(self, module: types.ModuleType, **overrides):
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def maybe_enable_amp(parallel_dims, mixed_precision_param: str, device_type: str):
    """Compute in `training.mixed_precision_param` in every layout: FSDP2 casts where it wraps
    the model (any dp or cp), autocast everywhere else. torchtitan 0.2.2 computes tp or pp
    layouts without data parallelism in fp32, e.g. the folded tp 2 x ep 2 on 2 GPUs."""
    dtype = TORCH_DTYPE_MAP[mixed_precision_param]
    if parallel_dims.dp_cp_enabled or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _set_pg_timeouts_gloo(timeout: timedelta, parallel_dims) -> None:
    # torchtitan's, without the CUDA device id of its barrier
    dist.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def trainer_names() -> dict:
    """The names FoldTrainer's copies of Trainer.__init__ and train see."""
    dev = device_type()
    return {
        "utils": Names(tt_utils, device_type=dev, device_module=getattr(torch, dev)),
        "dist_utils": Names(
            dist_utils,
            maybe_enable_amp=maybe_enable_amp,
            set_pg_timeouts=dist_utils.set_pg_timeouts if dev == "cuda" else _set_pg_timeouts_gloo,
        ),
        "CheckpointManager": FoldCheckpointManager,
        "time": Names(time, sleep=lambda seconds: None),
    }


def init_distributed(comm_config, base_folder: str) -> int:
    """torchtitan's init_distributed with this machine's backend (gloo without a GPU)."""
    return with_names(dist_utils.init_distributed, device_type=device_type())(comm_config, base_folder=base_folder)
