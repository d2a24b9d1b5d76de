"""Apply the layout to a model from outside, in this order: TP/SP and CP on the attention
mesh, routed experts on the expert mesh, activation checkpointing (whole blocks, or only
the MoE layers), compile per block, FSDP2 on each mesh's data-parallel dims.

The model knows nothing about parallelism; this function wraps it (on the meta device,
before `to_empty` and `init_weights`). Under pipelining, `parallel/pipeline.py` cuts the
model into stages and calls this function on each stage model.
"""

import functools

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.tools.logging import logger

from titan_fold.parallel.attention import apply_cp, apply_tp, sequence_positions
from titan_fold.parallel.experts import apply_expert_parallel, moe_layers
from titan_fold.parallel.mesh import Layout


def parallelize(model: nn.Module, layout: Layout, job_config) -> nn.Module:
    if layout.tp > 1:
        loss_parallel = not job_config.parallelism.disable_loss_parallel
        apply_tp(model, layout.attention["tp"], loss_parallel=loss_parallel)
    if layout.cp > 1:
        apply_cp(model, layout.attention["cp"])
    experts_on_own_mesh = layout.ep * layout.etp > 1
    if experts_on_own_mesh:
        apply_expert_parallel(model, layout)
    seq_mesh = layout.get_optional_mesh("cp_tp")
    for moe in moe_layers(model):
        # aux-loss statistics and full-sequence drop decisions over whole sequences,
        # whatever cp x tp cut them into
        moe.router.seq_mesh = seq_mesh
        moe.dispatcher.seq_mesh = seq_mesh
        if layout.cp > 1:
            moe.dispatcher.seq_positions = functools.partial(sequence_positions, layout.cp, layout.tp)
    ac = job_config.activation_checkpoint
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if ac.mode != "none":
        apply_ac(model, ac, model_compile_enabled=compile_model, base_folder=job_config.job.dump_folder)
    if ac.moe_layer_recompute:
        apply_moe_recompute(model)
    if compile_model:
        # per block: blocks repeat, so one compiled graph serves all of them
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(layer_id, torch.compile(block, backend=job_config.compile.backend))
        logger.info("Compiled each transformer block with torch.compile")
    if layout.dp_cp_enabled:
        apply_fsdp(model, layout, job_config, experts_on_own_mesh)
    return model


def apply_moe_recompute(model: nn.Module) -> None:
    """Checkpoint each block's MoE layer: backward runs its forward again (router, dispatch
    collectives, experts) instead of keeping the routed activations, which grow with top_k.

    A recompute may count the layer's statistics again; they are ratios and signs (aux loss
    mean, dropped fraction, load imbalance, aux-free load direction), so they stay the same.
    """
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe = checkpoint_wrapper(block.moe, preserve_rng_state=False)
    logger.info("Recomputing the MoE layers in backward (moe_layer_recompute)")


def apply_fsdp(model: nn.Module, layout: Layout, job_config, experts_on_own_mesh: bool) -> None:
    """FSDP2 over dp_shard x cp (HSDP when dp_replicate > 1) for dense parameters and over
    edp for routed experts on the expert mesh; gradients summed, not averaged.

    The loss is already divided by the global token count, so FSDP must not divide again.
    With edp = 1 the routed experts stay out of FSDP.
    """
    dims = [d for d, on in (("dp_replicate", layout.dp_replicate > 1), ("fsdp", layout.fsdp_enabled)) if on]
    mesh = layout.get_mesh(dims)
    training = job_config.training
    on_gpu = torch.cuda.is_available()
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param] if on_gpu else None,
        reduce_dtype=torch.float32,
    )
    # as torchtitan: under PP a stage runs several micro-batches' forwards before their
    # backwards, so by default it keeps the gathered parameters
    mode = job_config.parallelism.fsdp_reshard_after_forward
    reshard = mode == "always" or (mode == "default" and layout.pp == 1)
    expert_units = [moe.experts for moe in moe_layers(model)] if experts_on_own_mesh else []
    ignored = set()
    if expert_units and layout.edp == 1:
        # nothing to shard or reduce: FSDP over a one-rank mesh would only copy the weights
        # in and out (and again in backward). The experts cast their weights to the
        # activations' dtype themselves; autograd keeps that copy until backward.
        ignored = {p for unit in expert_units for p in unit.parameters()}
        expert_units = []
    elif expert_units:
        edp_mesh = layout.expert["edp"]
        local_experts = expert_units[0].w1.to_local().shape[0]
        # FSDP shards dim 0 by default; with fewer local experts than edp ranks shard the
        # ffn dim instead (every w has it at dim 1 or 2, divisible in any real model)
        placement = (lambda p: Shard(1)) if local_experts < layout.edp else None
        for unit in expert_units:
            fully_shard(unit, mesh=edp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard,
                        shard_placement_fn=placement)
    dense_units = [*model.layers.values(), model]
    for unit in dense_units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard and unit is not model,
                    ignored_params=ignored)
    for unit in expert_units + dense_units:
        unit.set_gradient_divide_factor(1.0)
        if not on_gpu:
            # gloo has no PREMUL_SUM
            unit.set_force_sum_reduction_for_comms(True)
    logger.info(f"Applied FSDP2 over {dims} (size {mesh.size()})")
