"""Choose the device once, before any torchtitan module reads it.

torchtitan 0.2.2 computes `device_type` at import time and falls back to "cuda" on a
machine without a GPU; several of its modules copy that value on import. We set it to
"cpu" (with gloo) when no GPU is present, in the one place every titan_fold import passes.
"""

import sys

import torch


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
    return device_type
