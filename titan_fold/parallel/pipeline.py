"""Pipeline parallelism: the layer stack cut at block boundaries into stages, run by a
`torch.distributed.pipelining` schedule (1F1B, Interleaved1F1B, GPipe).

Both meshes lead with the same "pp" dim, so a stage holds whole blocks: its attention and
its experts live on the pp rank's slice of the attention and expert meshes, and
`parallelize_fn` applies experts / FSDP / AC / compile to each stage model as to a whole
model. Stage s runs on pp rank s % pp ("loop" placement: rank r holds r, r + pp, ...).

Normalization. Without PP the trainer divides each micro-batch's loss sum by the global
token count before backward, and sets each MoE layer's aux_loss_scale to the micro-batch's
share of those tokens. Under PP the schedule calls backward itself, once per pipeline
micro-batch, so both happen here instead:
- the schedule's loss is `TokenNormalizedLoss`: loss sum * (1 / global tokens), its scale
  set by `pipeline_forward_backward` before every `step` (torchtitan 0.2.2 leaves the sum
  unnormalized, so gradients grow with the number of tokens);
- each pipeline micro-batch carries a kwarg `aux_loss_scale` [micro-batch size] (each
  sequence's valid tokens / global tokens); the schedule splits it with the batch and
  delivers it to every stage, where a forward pre-hook sums it and hands it to the
  stage's MoE layers. A stage without MoE layers drops it.
The loss is all-reduced over pp so that every rank (rank 0 writes metrics) reports it.
"""

import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    get_schedule_class,
)
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from titan_fold.common.errors import UserError
from titan_fold.common.moe_config import batch_overlap
from titan_fold.common.tensors import local
from titan_fold.models.mtp import without_mtp
from titan_fold.moe import moe_layers
from titan_fold.moe.replay import ROUTED_EXPERTS, record_routing, replay_routing
from titan_fold.parallel.mesh import Layout, LayoutError
from titan_fold.parallel.overlap import overlapped_pipeline
from titan_fold.parallel.parallelize import fsdp_compute_dtype

# schedules tested here; zero-bubble ones split backward in two, V ones place stages otherwise
SUPPORTED_SCHEDULES = (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B)
AUX_SCALE_KWARG = "aux_loss_scale"


def schedule_class(name: str) -> type:
    cls = get_schedule_class(name)
    if cls not in SUPPORTED_SCHEDULES:
        names = ", ".join(c.__name__.removeprefix("Schedule") for c in SUPPORTED_SCHEDULES)
        raise LayoutError(f"parallelism.pipeline_parallel_schedule = {name!r}: supported are {names}")
    return cls


def split_layers(n_layers: int, num_stages: int, first_less: int = 1, last_less: int = 1) -> list[list[str]]:
    """Module FQNs of each stage: contiguous blocks, at least one per stage, balanced so
    that the embedding counts as `first_less` blocks and norm + output as `last_less`."""
    if n_layers < num_stages:
        raise LayoutError(f"{num_stages} pipeline stages need at least as many layers; the model has {n_layers}")
    counts = [1] * num_stages
    load = [1 + first_less * (s == 0) + last_less * (s == num_stages - 1) for s in range(num_stages)]
    for _ in range(n_layers - num_stages):
        s = load.index(min(load))  # lightest stage, earliest on ties
        counts[s] += 1
        load[s] += 1
    stages, start = [], 0
    for s, n in enumerate(counts):
        fqns = [f"layers.{i}" for i in range(start, start + n)]
        start += n
        stages.append(
            (["tok_embeddings"] if s == 0 else []) + fqns + (["norm", "output"] if s == num_stages - 1 else [])
        )
    return stages


def stage_fqns(parallelism, n_layers: int, pp: int) -> list[list[str]]:
    """Every stage's module FQNs from [parallelism]: module_fqns_per_model_part as given,
    else pipeline_parallel_layers_per_stage (stage count = ceil((layers + first_less +
    last_less) / layers_per_stage)), else one stage per rank (two for looped schedules)."""
    single = issubclass(schedule_class(parallelism.pipeline_parallel_schedule), PipelineScheduleSingle)
    first_less = parallelism.pipeline_parallel_first_stage_less_layers
    last_less = parallelism.pipeline_parallel_last_stage_less_layers
    if parallelism.module_fqns_per_model_part is not None:
        stages = [list(s) for s in parallelism.module_fqns_per_model_part]
        expected = ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]
        if [f for s in stages for f in s] != expected or not all(stages):
            raise LayoutError(
                "parallelism.module_fqns_per_model_part: non-empty stages that list tok_embeddings, "
                f"layers.0 .. layers.{n_layers - 1}, norm, output once each, in this order; got {stages}"
            )
    elif parallelism.pipeline_parallel_layers_per_stage is not None:
        per_stage = parallelism.pipeline_parallel_layers_per_stage
        stages = split_layers(
            n_layers, math.ceil((n_layers + first_less + last_less) / per_stage), first_less, last_less
        )
    else:
        stages = split_layers(n_layers, pp * (1 if single else 2), first_less, last_less)
    if len(stages) % pp or (single and len(stages) != pp):
        kind = "one stage per rank" if single else "a multiple of pp stages"
        raise LayoutError(
            f"{len(stages)} pipeline stages over pp = {pp}: schedule "
            f"{parallelism.pipeline_parallel_schedule} needs {kind}"
        )
    return stages


def format_stages(stages: list[list[str]], pp: int) -> str:
    """One line per stage: its pp rank and modules, consecutive layers as a range."""
    lines = []
    for s, fqns in enumerate(stages):
        layers = [int(f.split(".")[1]) for f in fqns if f.startswith("layers.")]
        names = [f for f in fqns if not f.startswith("layers.")]
        if layers:
            span = f"layers.{layers[0]}" if len(layers) == 1 else f"layers.{layers[0]}-{layers[-1]}"
            names.insert(1 if fqns[0] == "tok_embeddings" else 0, span)
        lines.append(f"stage {s} on pp rank {s % pp}: {', '.join(names)}")
    return "\n".join(lines)


def stage_model(model: nn.Module, fqns: list[str]) -> nn.Module:
    """A copy of the (meta) model with only these modules; the rest set to None / deleted."""
    stage = copy.deepcopy(model)
    keep = set(fqns)
    stage.embeds_tokens = "tok_embeddings" in keep
    if "output" not in keep:
        stage.mtp = None
    elif stage.mtp is not None:
        # the MTP layers embed the tokens ahead: the last stage holds a copy of the first
        # stage's embedding, kept equal by sync_embedding_copies
        keep.add("tok_embeddings")
    for name in ("tok_embeddings", "norm", "output"):
        if name not in keep:
            setattr(stage, name, None)
    for layer_id in list(stage.layers.keys()):
        if f"layers.{layer_id}" not in keep:
            del stage.layers[layer_id]
    return stage


class TokenNormalizedLoss:
    """loss_fn(pred, labels) * scale, with scale = 1 / global valid tokens set per step."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.scale: torch.Tensor | float = 1.0

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(pred, labels) * self.scale


class StageHooks:
    """A forward pre-hook on one stage model.

    It pops the `aux_loss_scale` kwarg [micro-batch size] and gives its sum to the
    stage's MoE layers as a new tensor (not `fill_`: under 1F1B the next micro-batch's
    forward runs before this one's backward, which still needs the old value).
    """

    def __init__(self, model: nn.Module):
        self.moes = moe_layers(model)
        model.register_forward_pre_hook(self.pre_forward, with_kwargs=True)

    @torch.no_grad()
    def pre_forward(self, module, args, kwargs):
        scale = kwargs.pop(AUX_SCALE_KWARG, None)
        if scale is not None and not scale.is_meta:
            value = scale.sum()  # []
            for moe in self.moes:
                moe.aux_loss_scale = value
        return args, kwargs


def stage_io(stage: int, num_stages: int, layout: Layout, job_config, model_args) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of one stage for one pipeline micro-batch, as meta tensors, given to
    PipelineStage up front: the schedule then infers no shapes (no stand-in forward and
    backward, no pickled shape exchange between ranks, which a fake process group cannot
    carry) and its first step is like every other.

    Tokens [mb, s/cp] go into stage 0; hidden states [mb, s/cp/tp] (sequence parallel)
    travel between stages; logits [mb, s/cp, vocab] (their global shape under loss
    parallel) leave the last. Dtypes: FSDP2 (any dp or cp) computes in
    mixed_precision_param on the GPU (parallelize.fsdp_compute_dtype), so everything is in that
    dtype; elsewhere the residual stream stays in the parameters' dtype and autocast
    (trainer/world.py: maybe_enable_amp) gives the logits in mixed_precision_param.
    """
    tr = job_config.training
    params = TORCH_DTYPE_MAP[tr.dtype]
    compute = TORCH_DTYPE_MAP[tr.mixed_precision_param]
    if layout.dp_cp_enabled:
        hidden = logits = fsdp_compute_dtype(tr) or params
    else:
        hidden, logits = params, params if compute == torch.float32 else compute
    mb, s = job_config.parallelism.pipeline_parallel_microbatch_size, tr.seq_len // layout.cp
    meta = torch.device("meta")
    # requires_grad: gradients travel back along the hidden states
    h = torch.empty(mb, s // layout.tp, model_args.dim, dtype=hidden, device=meta, requires_grad=True)
    first = torch.empty(mb, s, dtype=torch.int64, device=meta) if stage == 0 else h
    last = (
        torch.empty(mb, s, model_args.vocab_size, dtype=logits, device=meta, requires_grad=True)
        if stage == num_stages - 1
        else h
    )
    return first, last


def check_pipeline(job_config, model_args, pp: int) -> tuple[type, list[list[str]], int]:
    """Validate the [parallelism] pipeline settings against the model, before any process
    group: -> (schedule class, every stage's module FQNs, pipeline micro-batches per step)."""
    p = job_config.parallelism
    if p.pipeline_parallel_schedule_csv:
        raise LayoutError("parallelism.pipeline_parallel_schedule_csv: not supported; name a schedule instead")
    if model_args.tie_embeddings:
        raise LayoutError("pipeline parallelism with tied embeddings: the first and last stages would share a weight")
    cls = schedule_class(p.pipeline_parallel_schedule)
    mb_size, local_batch = p.pipeline_parallel_microbatch_size, job_config.training.local_batch_size
    if local_batch % mb_size:
        raise LayoutError(
            f"training.local_batch_size = {local_batch}: not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size = {mb_size}"
        )
    stages, n_microbatches = stage_fqns(p, model_args.n_layers, pp), local_batch // mb_size
    # the schedules' own rules, which they would otherwise raise after the process groups exist
    rounds = max(1, n_microbatches // pp)
    if (cls is Schedule1F1B and n_microbatches < pp) or (cls is ScheduleInterleaved1F1B and n_microbatches % rounds):
        need = f"at least pp = {pp}" if cls is Schedule1F1B else f"a multiple of {rounds} (rounds of pp = {pp})"
        raise LayoutError(
            f"{n_microbatches} pipeline micro-batches per step (training.local_batch_size {local_batch} / "
            f"parallelism.pipeline_parallel_microbatch_size {mb_size}): {p.pipeline_parallel_schedule} needs {need}"
        )
    return cls, stages, n_microbatches


def pipeline(model: nn.Module, layout: Layout, job_config, device: torch.device, model_args, parallelize_fn, loss_fn):
    """torchtitan's TrainSpec.pipelining_fn: -> (schedule, model_parts, has_first_stage, has_last_stage)."""
    cls, all_fqns, n_microbatches = check_pipeline(job_config, model_args, layout.pp)
    pp_mesh = layout.get_mesh("pp")
    pp_rank, num_stages = pp_mesh.get_local_rank(), len(all_fqns)
    stages, model_parts, hooks = [], [], []
    for s in range(pp_rank, num_stages, layout.pp):
        part = parallelize_fn(stage_model(model, all_fqns[s]), layout, job_config)
        hooks.append(StageHooks(part))
        model_parts.append(part)
        inputs, outputs = stage_io(s, num_stages, layout, job_config, model_args)
        stages.append(
            PipelineStage(
                part, s, num_stages, device, input_args=inputs, output_args=outputs, group=pp_mesh.get_group()
            )
        )
        logger.info(f"Pipeline stage {s} of {num_stages} on pp rank {pp_rank}: {all_fqns[s]}")
    token_loss = TokenNormalizedLoss(loss_fn)
    if batch_overlap(model_args.moe.ep_overlap):  # the steady state's pairs overlapped (parallel/overlap.py)
        schedule = overlapped_pipeline(cls, stages, n_microbatches, token_loss, [h.pre_forward for h in hooks])
    else:
        single = issubclass(cls, PipelineScheduleSingle)
        schedule = cls(
            stages[0] if single else stages, n_microbatches=n_microbatches, loss_fn=token_loss, scale_grads=False
        )
    # pipeline_forward_backward sets its scale every step
    schedule.token_loss = token_loss
    logger.info(f"Pipeline schedule {cls.__name__}: {n_microbatches} micro-batches, {num_stages} stages")
    return schedule, model_parts, any(s.is_first for s in stages), any(s.is_last for s in stages)


def pipeline_forward_backward(trainer, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
    """The PP branch of FoldTrainer.forward_backward_step: forward and backward of one
    local batch through the schedule; returns loss sum / global tokens (on every pp rank)."""
    schedule = trainer.pp_schedule
    # each whole sequence's share of the global tokens (as without PP: the router gathers its
    # statistics over cp x tp), split into micro-batches with the batch
    aux_scale = (labels != IGNORE_INDEX).sum(dim=1).float() / global_valid_tokens  # [local_batch]
    inputs, labels, extra_inputs, extra_kwargs = trainer.post_dataloading_process(input_dict, labels)
    positions = extra_kwargs.get("positions")
    if positions is not None and positions.dim() == 1:
        # cp: one row of global positions [s/cp] for the batch; the schedule splits kwargs on dim 0
        extra_kwargs["positions"] = positions.expand(inputs.shape[0], -1)  # [local_batch, s/cp]
    schedule.token_loss.scale = 1.0 / global_valid_tokens
    last = trainer.pp_has_last_stage
    losses: list | None = [] if last else None
    tokens = inputs
    with trainer.train_context(), trainer.maybe_enable_amp:
        inputs = (inputs,) if trainer.pp_has_first_stage else ()
        extra = extra_inputs if trainer.pp_has_first_stage else {}
        if trainer.model_args.moe.routing_replay == "recorded":
            # R2: the schedule's forward-only pass records each stage's layers' routing, which
            # the training pass replays
            if not hasattr(schedule, "eval"):
                raise UserError(
                    "moe.routing_replay = 'recorded' with parallelism.pipeline_parallel_degree > 1: this "
                    "torch's pipeline schedules have no forward-only eval(); replay 'rollout' ids or choose one"
                )
            with record_routing(trainer.model_parts, tokens) as recording:
                schedule.eval(
                    *inputs,
                    **extra,
                    **without_mtp(extra_kwargs),
                    **{AUX_SCALE_KWARG: aux_scale},
                    target=labels if last else None,
                    losses=[] if last else None,
                )
            assert recording.recorded is not None  # set as the block exits
            extra_kwargs[ROUTED_EXPERTS] = replay_routing(recording.recorded, tokens)
        schedule.step(
            *inputs,
            **extra,
            **extra_kwargs,
            **{AUX_SCALE_KWARG: aux_scale},
            target=labels if last else None,
            losses=losses,
            return_outputs=False,
        )
    loss = torch.stack(losses).sum().detach() if last else torch.zeros((), device=trainer.device)
    if isinstance(loss, DTensor):  # loss parallel under tp
        loss = loss.full_tensor()
    loss = loss.to(trainer.device).float()
    dist.all_reduce(loss, group=trainer.parallel_dims.get_mesh("pp").get_group())
    return loss


def embedding_copies(model_parts: list[nn.Module]) -> list[torch.Tensor]:
    """The parameters of this pp rank's copy of the embedding: the last stage's, for its MTP
    layers ([] on a rank without one)."""
    return [
        p
        for part in model_parts
        if part.mtp is not None and not part.embeds_tokens
        for p in part.tok_embeddings.parameters()
    ]


@torch.no_grad()
def sync_embedding_copies(model_parts: list[nn.Module], pp_mesh, what: str) -> None:
    """Keep the MTP layers' embedding on the last stage equal to the first stage's (with
    mtp_layers > 0 and pp > 1), between pp rank 0 and pp rank pp - 1: the same dp / cp / tp
    coordinates, so the same local shards. what = "weights": pp rank 0 sends its weights
    (after initialization); "grads": both ranks add the other's gradient (before clipping and
    the optimizer step), so both copies take the same update. Other pp ranks take no part."""
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    if pp == 1 or rank not in (0, pp - 1):
        return
    if rank == 0:
        params = [p for part in model_parts if part.embeds_tokens for p in part.tok_embeddings.parameters()]
    else:
        params = embedding_copies(model_parts)
    group = pp_mesh.get_group()
    peer = dist.get_global_rank(group, pp - 1 if rank == 0 else 0)
    for p in params:
        shard = local(p)
        if what == "weights":
            if rank == 0:
                dist.send(shard.contiguous(), peer, group=group)
            else:
                buf = torch.empty_like(shard)
                dist.recv(buf, peer, group=group)
                shard.copy_(buf)
            continue
        grad = local(p.grad)
        buf = torch.empty_like(grad)
        ops = [dist.P2POp(dist.isend, grad.contiguous(), peer, group), dist.P2POp(dist.irecv, buf, peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        grad.add_(buf)
