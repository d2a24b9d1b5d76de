"""Choose the device once, before any torchtitan module reads it.

torchtitan 0.2.2 computes `device_type` at import time and falls back to "cuda" on a
machine without a GPU; several of its modules copy that value on import. We set it to
"cpu" (with gloo) when no GPU is present, in the one place every titan_fold import passes,
and swap its CUDA-only process-group timeout helper for one that works on gloo.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def settle_device() -> str:
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = device_type
    tt_utils.device_module = getattr(torch, device_type)
    # modules that did `from torchtitan.tools.utils import device_type` before we got here
    for name in ("torchtitan.distributed.utils", "torchtitan.distributed.parallel_dims", "torchtitan.tools.profiling"):
        module = sys.modules.get(name)
        if module is not None:
            if hasattr(module, "device_type"):
                module.device_type = device_type
            if hasattr(module, "device_module"):
                module.device_module = tt_utils.device_module
    if device_type == "cpu":
        import torchtitan.distributed.utils as tt_dist_utils

        # its version passes a CUDA device id to the barrier
        tt_dist_utils.set_pg_timeouts = _set_pg_timeouts_gloo
    return device_type


def _set_pg_timeouts_gloo(timeout: timedelta, parallel_dims) -> None:
    dist.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
