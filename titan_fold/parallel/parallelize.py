"""Apply the layout to a model from outside: activation checkpointing, compile, FSDP2.

The model knows nothing about parallelism; this function wraps it. Attention TP/SP/CP and
pipelining are applied by their own modules as they land; until then `check_supported`
rejects those degrees before any process group exists.
"""

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.tools.logging import logger

from titan_fold.parallel.layout import Layout, LayoutError

# degrees this build can apply; the rest are rejected up front
_NOT_YET = ("tp", "cp", "pp", "ep", "etp")


def check_supported(layout: Layout) -> None:
    unsupported = {name: getattr(layout, name) for name in _NOT_YET if getattr(layout, name) > 1}
    if unsupported:
        degrees = ", ".join(f"{k}={v}" for k, v in unsupported.items())
        raise LayoutError(
            f"{degrees}: this build applies data parallelism (dp_replicate x dp_shard, FSDP2) only; "
            "set these degrees to 1"
        )


def parallelize(model: nn.Module, layout: Layout, job_config) -> nn.Module:
    check_supported(layout)
    ac = job_config.activation_checkpoint
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if ac.mode != "none":
        apply_ac(model, ac, model_compile_enabled=compile_model, base_folder=job_config.job.dump_folder)
    if compile_model:
        # per block: blocks repeat, so one compiled graph serves all of them
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(layer_id, torch.compile(block, backend=job_config.compile.backend))
        logger.info("Compiled each transformer block with torch.compile")
    if layout.dp_replicate > 1 or layout.fsdp_enabled:
        apply_fsdp(model, layout, job_config)
    return model


def apply_fsdp(model: nn.Module, layout: Layout, job_config) -> None:
    """FSDP2 over dp_shard x cp, HSDP when dp_replicate > 1; gradients summed, not averaged.

    The loss is already divided by the global token count, so FSDP must not divide again.
    """
    dims = [d for d, on in (("dp_replicate", layout.dp_replicate > 1), ("fsdp", layout.fsdp_enabled)) if on]
    mesh = layout.get_mesh(dims)
    training = job_config.training
    on_gpu = torch.cuda.is_available()
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param] if on_gpu else None,
        reduce_dtype=torch.float32,
    )
    reshard = job_config.parallelism.fsdp_reshard_after_forward != "never"
    units = [*model.layers.values(), model]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard and unit is not model)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        if not on_gpu:
            # gloo has no PREMUL_SUM
            unit.set_force_sum_reduction_for_comms(True)
    logger.info(f"Applied FSDP2 over {dims} (size {mesh.size()})")
