"""Apply the layout to a model from outside, in this order: TP/SP and CP on the attention
mesh, routed experts on the expert mesh, activation checkpointing (whole blocks, or only
the MoE layers), compile per block, FSDP2 on each mesh's data-parallel dims.

The model knows nothing about parallelism; this function wraps it (on the meta device,
before `to_empty` and `init_weights`). Under pipelining, `parallel/pipeline.py` cuts the
model into stages and calls this function on each stage model.
"""

import contextlib
import gc

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.tools.logging import logger

from titan_fold.common.tensors import model_fqn
from titan_fold.compat.dispatch import TorchDispatchMode, disable_current_modes
from titan_fold.compat.distributed import CheckpointWrapper, checkpoint_wrapped, checkpoint_wrapper
from titan_fold.compat.ops import mark_static_address
from titan_fold.moe import moe_layers
from titan_fold.parallel.attention import apply_cp, apply_tp
from titan_fold.parallel.experts import apply_moe
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.placement import Placed, placement_plan


def parallelize(model: nn.Module, layout: Layout, job_config) -> nn.Module:
    plan = placement_plan(model.args, layout)
    if layout.tp > 1:
        loss_parallel = not job_config.parallelism.disable_loss_parallel
        apply_tp(model, layout.attention["tp"], loss_parallel=loss_parallel)
    if layout.cp > 1:
        apply_cp(model, layout.attention["cp"])
    apply_moe(model, layout, plan)
    ac = job_config.activation_checkpoint
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if ac.mode not in ("none", "moe_layers"):
        apply_ac(model, ac, model_compile_enabled=compile_model, base_folder=job_config.job.dump_folder)
        if ac.mode == "selective" and ac.selective_ac_option == "op" and layout.pp > 1 and layout.edp > 1:
            # only where the experts' FSDP unit can become a root in the recompute: elsewhere the
            # extra dispatch mode would cost every eager op a Python call for nothing
            keep_profiler_ranges_out_of_sac(model)
    if ac.mode == "moe_layers":
        apply_moe_recompute(model)
    if compile_model:
        # per block: blocks repeat, so one compiled graph serves all of them
        for layer_id, block in model.layers.named_children():
            mode = "reduce-overhead" if cuda_graphs(job_config) else None
            model.layers.register_module(layer_id, torch.compile(block, backend=job_config.compile.backend, mode=mode))
        logger.info("Compiled each transformer block with torch.compile")
    apply_fsdp(model, layout, plan, job_config)
    return model


def cuda_graphs(job_config) -> bool:
    """Whether compiled blocks replay as CUDA graphs: compile.cudagraphs, which needs compile.enable
    (a job config without the key, torchtitan's own, has none)."""
    return job_config.compile.enable and getattr(job_config.compile, "cudagraphs", False)


def mark_static_buffers(model_parts) -> None:
    """Under compile.cudagraphs, after the weights exist: the MoE layers' buffers (statistics and
    aux-free counts, updated in place by every call) keep their addresses, and say so to
    torch.compile. CUDA graphs replay in-place updates only of inputs at fixed addresses; a
    block that FSDP2 wraps reaches them as plain inputs, and its forward would not be captured
    (its backward then copies every saved activation into its graph's inputs)."""
    for moe in moe_layers(model_parts):
        for buffer in moe.buffers():
            mark_static_address(buffer)


def release_cuda_graphs(job_config) -> None:
    """Under compile.cudagraphs, before the process group is destroyed: free the recorded graphs.
    A graph that captured NCCL kernels holds its communicator, and destroying the communicator
    first hangs (pytorch/pytorch#115388). torch.compiler.reset() drops torch.compile's graphs;
    the collection frees those only reachable through cycles (torchtitan turns automatic
    collection off)."""
    if cuda_graphs(job_config):
        torch.compiler.reset()
        gc.collect()


def fsdp_compute_dtype(training) -> torch.dtype | None:
    """The dtype FSDP2 casts parameters and inputs to: mixed_precision_param on a GPU; None
    (the parameters' own) on the CPU."""
    return TORCH_DTYPE_MAP[training.mixed_precision_param] if torch.cuda.is_available() else None


class _ProfilerRangesBeneath(TorchDispatchMode):
    """Runs torch.profiler's range ops (the `profiler` namespace: they take a name and return
    a handle, no tensor) beneath every dispatch mode, so the selective-checkpoint modes it is
    entered inside neither store nor look them up; every other op goes to them unchanged."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "profiler":
            with disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _with_profiler_ranges_beneath(context):
    with context, _ProfilerRangesBeneath():
        yield


def _profiler_ranges_beneath(context_fn):
    """op-level SAC's pair of contexts (forward, recompute), each with profiler ranges kept out."""

    def contexts():
        forward, recompute = context_fn()
        if torch.compiler.is_compiling():  # dynamo traces torch's own modes only
            return forward, recompute
        return _with_profiler_ranges_beneath(forward), _with_profiler_ranges_beneath(recompute)

    return contexts


def keep_profiler_ranges_out_of_sac(model: nn.Module) -> None:
    """Op-level selective AC (torchtitan's apply_ac) as it is, but blind to profiler ranges.

    torch >= 2.13's selective checkpointing requires the recompute to issue exactly the ops of
    the forward, profiler ranges included. The experts' own FSDP unit (edp > 1), nested in the
    checkpointed block, finds no forward root in progress when the recompute runs it, becomes
    one and opens a profiler range (FSDP::root_pre_forward) that the forward did not: the first
    backward fails (docs/planning.md has the 4-rank command). A range computes nothing, so the
    check is kept for every other op; torch 2.11 checks only the ops it saved."""
    for layer_id, block in model.layers.named_children():
        if not isinstance(block, CheckpointWrapper):
            continue
        kwargs = dict(block.checkpoint_fn.keywords)
        kwargs.pop("use_reentrant")  # checkpoint_wrapper sets it (NO_REENTRANT)
        kwargs["context_fn"] = _profiler_ranges_beneath(kwargs["context_fn"])
        model.layers.register_module(layer_id, checkpoint_wrapper(checkpoint_wrapped(block), **kwargs))


def apply_moe_recompute(model: nn.Module) -> None:
    """Checkpoint each block's MoE layer: backward runs its forward again (router, dispatch
    collectives, experts) instead of keeping the routed activations, which grow with top_k.

    A recompute may count the layer's statistics again; they are ratios and signs (aux loss
    mean, dropped fraction, load imbalance, aux-free load direction), so they stay the same.
    """
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe = checkpoint_wrapper(block.moe, preserve_rng_state=False)
    logger.info('Recomputing the MoE layers in backward (activation_checkpoint.mode = "moe_layers")')


def apply_fsdp(model: nn.Module, layout: Layout, plan: dict[str, Placed], job_config) -> None:
    """FSDP2 as the plan says: one unit per MoE layer's routed experts (over edp), per block
    and for the rest (over dp_shard x cp, HSDP with dp_replicate), each parameter sharded on
    its plan's dim; parameters the plan keeps out of FSDP are ignored. Gradients are summed,
    not averaged: the loss is already divided by the global token count.
    """
    placed = {id(p): plan[model_fqn(fqn)] for fqn, p in model.named_parameters()}
    outside = {p for p in model.parameters() if not placed[id(p)].fsdp_mesh}
    if len(outside) == len(placed):
        return
    on_gpu = torch.cuda.is_available()
    mp_policy = MixedPrecisionPolicy(param_dtype=fsdp_compute_dtype(job_config.training), reduce_dtype=torch.float32)
    # as torchtitan: under PP a stage runs several micro-batches' forwards before their
    # backwards, so by default it keeps the gathered parameters
    mode = job_config.parallelism.fsdp_reshard_after_forward
    reshard = mode == "always" or (mode == "default" and layout.pp == 1)
    wrapped = set(outside)
    units = []
    for unit in [moe.experts for moe in moe_layers(model)] + [*model.layers.values(), model]:
        params = [p for p in unit.parameters() if p not in wrapped]
        if not params:
            continue
        meshes = {placed[id(p)].fsdp_mesh for p in params}
        if len(meshes) != 1:
            raise AssertionError(f"one FSDP unit, parameters on different FSDP meshes {meshes}: fix placement.py")
        fully_shard(
            unit,
            mesh=layout.get_mesh(list(meshes.pop())),
            mp_policy=mp_policy,
            reshard_after_forward=reshard and unit is not model,
            shard_placement_fn=lambda p: Shard(placed[id(p)].fsdp_dim),
            ignored_params=outside & set(unit.parameters()),
        )
        unit.set_gradient_divide_factor(1.0)
        if not on_gpu:
            # gloo has no PREMUL_SUM
            unit.set_force_sum_reduction_for_comms(True)
        wrapped.update(unit.parameters())  # FSDP2's own parameters now
        units.append(unit)
    logger.info(f"Applied FSDP2 to {len(units)} units as placement_plan says")
