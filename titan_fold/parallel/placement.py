"""Where every parameter lives: the placement plan, the one source the parallelize step executes.

    tp_plan(model, sequence_parallel, loss_parallel) -> {module FQN: ParallelStyle}
    placement_plan(model_args, layout, stages=None)  -> {parameter FQN: Placed}

`tp_plan` is the tensor-parallel style of every module, with the layouts its inputs and
outputs arrive in and leave in; `attention.apply_tp` hands it to `parallelize_module` as is.
`placement_plan` says, for every parameter: its mesh, the DTensor placements on that mesh's
model-parallel dims (the tp ones read off `tp_plan`), the FSDP2 mesh and the tensor dim FSDP2
shards, and the pipeline stage that holds it. `parallel/experts.py` distributes the routed
experts by it and `parallelize.apply_fsdp` wraps by it; nothing else decides a placement.
`format_plan` prints it (`python -m titan_fold.layout --placements`) and
tests/test_placement.py checks, layout by layout, that every parameter the parallelize step
produces is the DTensor this plan describes.

Choices, and why:
- wq, wk, wv (and their Qwen2 biases), w1, w3: colwise `Shard(0)` (out features = heads or
  ffn width); wo, w2: rowwise `Shard(1)` (in features). Heads and ffn columns never mix.
- tok_embeddings: rowwise = `Shard(0)` of the [vocab, dim] table; each rank looks up the
  ids it holds, the partial rows are reduce-scattered into sequence shards (output `Shard(1)`).
- output: colwise `Shard(0)` of [vocab, dim]: logits come out sharded on vocab, which
  loss parallel consumes without gathering them.
- shared expert: colwise/rowwise like the dense FFN, not replicated: it is the largest dense
  block of Qwen2-57B-A14B (3 x 20480 x 3584 per layer) and TP divides it by tp, at the price
  of an all-gather + reduce-scatter of the layer's tokens (the same traffic as attention).
- multi-head latent attention (DeepSeek-V3, `mla_plan`): the up-projections to the heads (wq,
  or wq_b after q LoRA; wkv_b) colwise, wo rowwise; the down-projections to the latents (wq_a,
  wkv_a), their norms and the rotary key wk_rope replicated over tp (`ReplicateParallel`: the
  latents are narrow, 512 + 64 of 7168 for kv, and every head needs all of them).
- norms (Qwen3's q/k norms too: each tp rank normalizes its own heads), router gate,
  shared_expert_gate, wo's bias: `Replicate` on tp. Under sequence parallelism each
  tp rank feeds the first four different tokens, so their gradients are partial sums that
  are reduced over tp (`TokenwiseReplicate`, `attention.apply_tp`; `Placed.tp_partial_grad`);
  wo's bias is added after wo's reduction and gets the whole gradient on every tp rank.
- routed experts w13 [E, 2 * ffn, dim] (gate and up rows alternating) / w2 [E, dim, ffn]:
  `Shard(0)` (experts) on ep, the ffn dim on etp (w13's rows: whole (gate, up) pairs).
- FSDP2: dense parameters over dp_shard x cp (cp ranks hold different tokens of the same
  sequences, so their gradients are summed like data parallel ones), replicated over
  dp_replicate (HSDP); routed experts over edp, on dim 0, or on the model width `dim` (w13:
  dim 2, w2: dim 1) when a rank holds fewer experts than there are edp ranks (E/ep <
  edp), so every edp rank holds a real shard. `dim` is split by neither ep nor etp, so FSDP's
  shard is a plain `Shard` there, not one interleaved with etp's. With edp = 1 the experts
  stay out of FSDP (nothing to shard or reduce).
"""

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from titan_fold.compat.distributed import ParallelStyleHooks, StridedShard
from titan_fold.parallel.mesh import Layout

ATTENTION, EXPERT = "attention", "expert"


class TokenwiseReplicate(ParallelStyleHooks):
    """A module with replicated weights applied row by row to this rank's tokens [T_local, dim].

    For the router gate and shared_expert_gate under sequence parallelism: inputs become
    DTensors `Shard(0)` (each tp rank holds different token rows), weights `Replicate`, the
    output goes back to a plain local tensor. DTensor then knows the weight gradient is a sum
    over tp ranks (it comes out `Partial`); `attention._grads_like_params` reduces it.
    """

    @staticmethod
    def _replicate(name, module, mesh):
        for p_name, param in list(module.named_parameters(recurse=False)):
            # from_local: every rank built the same weights (meta, or one seed); no broadcast
            module.register_parameter(
                p_name, nn.Parameter(DTensor.from_local(param, mesh, [Replicate()], run_check=False))
            )

    @staticmethod
    def _input(module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Shard(0)], run_check=False) for x in inputs)

    @staticmethod
    def _output(module, output, mesh):
        return output.to_local()

    def apply_to(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate, self._input, self._output)


class ReplicateParallel(ParallelStyleHooks):
    """A module with replicated weights that every tp rank applies to the same tokens (the
    attention's input, already gathered over the sequence); returns a plain tensor.

    For MLA's down-projections and their norms. The output's gradient arrives whole when a
    colwise layer consumes it (its input gradient is reduced over tp on the way back), or as
    this rank's share when only this rank's heads use it (`partial_grad`: MLA's rotary key,
    shared by all heads): marked `Partial`, DTensor sums it over tp where it meets the weight
    and the input gradients.
    """

    def __init__(self, partial_grad: bool = False):
        super().__init__()
        self.partial_grad = partial_grad

    def _input(self, module, inputs, mesh):
        return tuple(
            x.redistribute(placements=[Replicate()])
            if isinstance(x, DTensor)
            else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            for x in inputs
        )

    def _output(self, module, output, mesh):
        return output.to_local(grad_placements=[Partial()] if self.partial_grad else None)

    def apply_to(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, TokenwiseReplicate._replicate, self._input, self._output)


class HeadShard(ParallelStyleHooks):
    """A module whose parameters are one value per attention head ([heads, ...]: GPT-OSS's sinks;
    Gated DeltaNet's decays, and its convolutions' channels, heads x head dim), sharded with the
    heads, `Shard(0)`; the attention reads this rank's part (its local heads)."""

    @staticmethod
    def _shard(name, module, mesh):
        for p_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(p_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def apply_to(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._shard)


def linear_attention_plan(prefix: str) -> dict[str, ParallelStyle]:
    """Gated DeltaNet on tp, by heads: the q, k, v, z, b, a projections colwise (this rank's key
    heads and the value heads they serve), the convolutions' channels and the decays with them
    (`HeadShard`), wo rowwise (tp_plan, as every mixer's); the gated norm's weight, one for all
    heads, replicated, its gradient summed over tp (each rank normalizes its own heads)."""
    plan: dict[str, ParallelStyle] = {prefix + w: ColwiseParallel() for w in ("wq", "wk", "wv", "wz", "wb", "wa")}
    plan.update({prefix + m: HeadShard() for m in ("conv_q", "conv_k", "conv_v", "decay")})
    plan[prefix + "norm"] = TokenwiseReplicate()
    return plan


def mla_plan(prefix: str, attention: nn.Module) -> dict[str, ParallelStyle]:
    """Multi-head latent attention on tp: the up-projections (wq or wq_b, wkv_b) colwise by heads,
    wo rowwise; the down-projections to the latents (wq_a, wkv_a), their norms and the rotary
    key wk_rope (one for all heads) replicated, computed whole on every tp rank: they are
    narrow (kv_lora_rank + rope = 576 of DeepSeek-V3's 7168)."""
    plan = {
        prefix + "wkv_a": ReplicateParallel(),
        prefix + "kv_a_norm": ReplicateParallel(),
        prefix + "wkv_b": ColwiseParallel(),
        prefix + "wk_rope": ReplicateParallel(partial_grad=True),
    }
    if attention.wq is not None:
        plan[prefix + "wq"] = ColwiseParallel()
    else:
        plan.update(
            {
                prefix + "wq_a": ReplicateParallel(),
                prefix + "q_a_norm": ReplicateParallel(),
                prefix + "wq_b": ColwiseParallel(),
            }
        )
    return plan


def tp_plan(model: nn.Module, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """{module FQN: ParallelStyle} on the attention mesh's tp dim, for a model or a pipeline
    stage of it (modules a stage does not hold are left out).

    sequence_parallel: the residual stream is a DTensor `Shard(1)` (sequence) between blocks;
    norms and the MoE run on sequence shards. Without it every tp rank runs them on the full
    sequence and they stay plain tensors. loss_parallel: logits leave the head sharded on vocab.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    # inside the MoE rows are tokens [T_local, dim]: Shard(0) when each rank holds different rows
    rows = Shard(0) if sequence_parallel else Replicate()
    keep_dtensor = sequence_parallel  # the residual stream stays a DTensor between blocks
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=not keep_dtensor
        )
    blocks = [(f"layers.{layer_id}.", block) for layer_id, block in model.layers.items()]
    for k, layer in model.mtp.layers.items() if getattr(model, "mtp", None) is not None else ():
        # Multi-Token Prediction: its norms and the projection of [embedding; hidden] act on
        # each rank's sequence shard with replicated weights; its block as any block; its
        # loss (over vocab-sharded logits under loss parallel) comes back as a plain tensor
        m = f"mtp.layers.{k}."
        blocks.append((m + "block.", layer.block))
        seq_style = SequenceParallel if sequence_parallel else None
        if seq_style is not None:
            for name in ("enorm", "hnorm", "eh_proj", "norm"):
                plan[m + name] = seq_style()
        if loss_parallel:
            plan[m + "loss"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=True
            )
    for p, block in blocks:
        if sequence_parallel:
            plan[p + "attention_norm"] = SequenceParallel()
        plan[p + "attention"] = PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
        )
        if hasattr(block.attention, "wkv_a"):
            plan.update(mla_plan(p + "attention.", block.attention))
        elif block.layer_type == "linear_attention":
            plan.update(linear_attention_plan(p + "attention."))
        else:
            for name in ("wq", "wk", "wv"):
                plan[p + f"attention.{name}"] = ColwiseParallel()
        plan[p + "attention.wo"] = RowwiseParallel(output_layouts=seq, use_local_output=not keep_dtensor)
        if getattr(block.attention, "sinks", None) is not None:
            plan[p + "attention.sinks"] = HeadShard()
        if getattr(block.attention, "q_norm", None) is not None:
            # Qwen3's per-head q/k norms: each tp rank normalizes its own heads
            # [b, s, heads/tp, head_dim], so the weight's gradient is a sum over tp
            plan[p + "attention.q_norm"] = TokenwiseReplicate()
            plan[p + "attention.k_norm"] = TokenwiseReplicate()
        if sequence_parallel:
            plan[p + "ffn_norm"] = SequenceParallel()
        if not block.moe_enabled:
            plan[p + "feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan[p + "feed_forward.w1"] = ColwiseParallel()
            plan[p + "feed_forward.w3"] = ColwiseParallel()
            plan[p + "feed_forward.w2"] = RowwiseParallel(output_layouts=seq, use_local_output=not keep_dtensor)
            continue
        if sequence_parallel:
            # the MoE takes and returns this rank's tokens as a plain tensor [b, s/tp, dim]: its
            # dispatcher only ever sees "the tokens of this rank", whatever the attention layout
            plan[p + "moe"] = PrepareModuleInputOutput(
                input_layouts=(seq,),
                desired_input_layouts=(seq,),
                use_local_input=True,
                output_layouts=(seq,),
                desired_output_layouts=(seq,),
                use_local_output=False,
            )
            plan[p + "moe.router.gate"] = TokenwiseReplicate()
        if block.moe.shared_expert is not None:
            # all-gather this rank's rows: the shared expert's tp shards need every token
            plan[p + "moe.shared_expert"] = PrepareModuleInput(
                input_layouts=(rows,), desired_input_layouts=(Replicate(),)
            )
            plan[p + "moe.shared_expert.w1"] = ColwiseParallel()
            plan[p + "moe.shared_expert.w3"] = ColwiseParallel()
            # back to this rank's rows: reduce-scatter under SP, all-reduce otherwise
            plan[p + "moe.shared_expert.w2"] = RowwiseParallel(output_layouts=rows)
        if sequence_parallel and block.moe.shared_expert_gate is not None:
            plan[p + "moe.shared_expert_gate"] = TokenwiseReplicate()
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def tp_placement(style: ParallelStyle, module: nn.Module, param_name: str) -> Placement | None:
    """The placement on tp a style gives one of its module's own parameters (None: not a DTensor)."""
    embedding = isinstance(module, nn.Embedding)  # [vocab, dim]: rows are the first dim, not out features
    if isinstance(style, ColwiseParallel):
        return Shard(1) if embedding else Shard(0)
    if isinstance(style, RowwiseParallel):
        return Shard(0) if embedding else (Shard(1) if param_name == "weight" else Replicate())
    if isinstance(style, HeadShard):
        return Shard(0)
    if isinstance(style, (SequenceParallel, TokenwiseReplicate, ReplicateParallel)):
        return Replicate()
    return None  # input/output layouts only: the module's parameters belong to its children


def tp_partial_grad(style: ParallelStyle | None, placement: Placement | None) -> bool:
    """Whether a parameter replicated on tp gets a different share of its gradient on each tp
    rank, which only a sum over tp makes whole: under sequence parallelism a norm, router gate
    or shared_expert_gate sees other tokens on each tp rank, Qwen3's q/k norms other heads; a
    rowwise bias is added to the output after its reduction and sees the whole gradient. A
    style may say so itself with a `partial_grad` attribute."""
    if not isinstance(placement, Replicate):
        return False
    return bool(getattr(style, "partial_grad", isinstance(style, (SequenceParallel, TokenwiseReplicate))))


# stacked routed experts: (ep placement, etp placement, model-width dim); etp shards the ffn dim
# (GPT-OSS's biases: w13_bias with its pairs; w2_bias whole on every etp rank, added once)
_EXPERT_RULES: dict[str, tuple[Placement, Placement, int]] = {
    "w13": (Shard(0), Shard(1), 2),  # [E, 2 * ffn, dim]
    "w2": (Shard(0), Shard(2), 1),  # [E, dim, ffn]
    "w13_bias": (Shard(0), Shard(1), 1),  # [E, 2 * ffn]
    "w2_bias": (Shard(0), Replicate(), 1),  # [E, dim]
}


def expert_placements(name: str, dims) -> tuple[Placement, ...]:
    """Placements of the stacked experts.<name> (w13, w2, their biases) on mesh dims among "ep", "etp"."""
    by_dim = dict(zip(("ep", "etp"), _EXPERT_RULES[name][:2], strict=True))
    return tuple(by_dim[d] for d in dims)


@dataclass(frozen=True)
class Placed:
    mesh: str  # "attention" or "expert": the mesh every dim below belongs to
    dims: tuple[str, ...]  # model-parallel dims of degree > 1 the tensor is laid out on
    placements: tuple[Placement, ...]  # one per entry of dims
    shape: tuple[int, ...]  # global shape
    tp_style: str = ""  # the ParallelStyle of its module on tp ("" when not on tp)
    # replicated on tp, with a different share of its gradient on each tp rank (tp_partial_grad)
    tp_partial_grad: bool = False
    # FSDP2's mesh, dims of degree > 1: () no FSDP; one dim: sharded over it; two: HSDP,
    # replicated over the first, sharded over the second
    fsdp_mesh: tuple[str, ...] = ()
    fsdp_dim: int = 0  # tensor dim FSDP2 shards
    stage: int = 0  # pipeline stage holding it
    # moe.hot_expert_replicas: the dims over which copies of it run, their gradients summed into
    # its own before FSDP's reduction (ep; moe/replicas.py); () without copies
    copies_grad: tuple[str, ...] = ()

    def local_shape(self, layout: Layout) -> tuple[int, ...]:
        """Shape of this rank's piece after the model-parallel placements (before FSDP)."""
        shape = list(self.shape)
        for dim, placement in zip(self.dims, self.placements, strict=True):
            if isinstance(placement, Shard):
                shape[placement.dim] = -(-shape[placement.dim] // layout.size(dim))
        return tuple(shape)

    def dtensor(self, layout: Layout) -> tuple[tuple[str, ...], tuple[Placement, ...]]:
        """(mesh dim names, placements) of the parameter as the model holds it after the
        parallelize step: FSDP2's dims first, then the model-parallel ones. FSDP2 shards a
        dim that a model-parallel dim already splits in interleaved pieces (`_StridedShard`)."""
        if not self.fsdp_mesh:
            return self.dims, self.placements
        split = math.prod(
            layout.size(d)
            for d, p in zip(self.dims, self.placements, strict=True)
            if isinstance(p, Shard) and p.dim == self.fsdp_dim
        )
        shard = StridedShard(self.fsdp_dim, split_factor=split) if split > 1 else Shard(self.fsdp_dim)
        fsdp = (Replicate(),) * (len(self.fsdp_mesh) - 1) + (shard,)
        return self.fsdp_mesh + self.dims, fsdp + self.placements


def _dense_fsdp_mesh(layout: Layout) -> tuple[str, ...]:
    return tuple(n for n in ("dp_replicate", "dp_shard_cp") if layout.size(n) > 1)


def placement_plan(
    model_args, layout: Layout, stages: list[list[str]] | None = None, sequence_parallel: bool = True
) -> dict[str, Placed]:
    """{FQN: Placed} for every parameter of `Transformer(model_args)` under `layout`.

    The FQNs are read off a model built on the meta device (no memory), so they are exactly
    the model's `named_parameters()` (a tied output head appears once, as tok_embeddings).
    stages: every pipeline stage's module FQNs (`pipeline.stage_fqns`); None = one stage.
    """
    from titan_fold.models import Transformer

    with torch.device("meta"):
        model = Transformer(model_args)
    styles = tp_plan(model, sequence_parallel) if layout.tp > 1 else {}
    stage_of = {fqn: s for s, fqns in enumerate(stages or [[]]) for fqn in fqns}
    experts_per_rank = model_args.moe.num_experts // layout.ep
    plan = {}
    for fqn, param in model.named_parameters():
        owner, name = fqn.rsplit(".", 1)
        top = re.findall(r"layers\.\d+|[^.]+", fqn)[0]  # the module a pipeline stage lists
        stage = stage_of.get(top, 0)
        if owner.endswith(".experts"):
            ep_place, etp_place, width = _EXPERT_RULES[name]
            dims = tuple(d for d in ("ep", "etp") if layout.size(d) > 1)
            plan[fqn] = Placed(
                EXPERT,
                dims,
                expert_placements(name, dims),
                tuple(param.shape),
                fsdp_mesh=("edp",) if layout.edp > 1 else (),
                fsdp_dim=width if experts_per_rank < layout.edp else 0,
                stage=stage,
                copies_grad=("ep",) if model_args.moe.hot_expert_replicas and layout.ep > 1 else (),
            )
            continue
        style = styles.get(owner)
        placement = tp_placement(style, model.get_submodule(owner), name) if style is not None else None
        plan[fqn] = Placed(
            ATTENTION,
            ("tp",) if placement else (),
            (placement,) if placement else (),
            tuple(param.shape),
            tp_style=type(style).__name__ if placement else "",
            tp_partial_grad=tp_partial_grad(style, placement),
            fsdp_mesh=_dense_fsdp_mesh(layout),
            stage=stage,
        )
    return plan


def _fmt_placement(p: Placement) -> str:
    return f"Shard({p.dim})" if isinstance(p, Shard) else type(p).__name__


def format_plan(plan: dict[str, Placed], layout: Layout | None = None) -> str:
    """One line per distinct parameter; blocks with identical entries are folded into a range.

    With a layout, each line also shows the per-rank shape after tp / ep / etp (before FSDP).
    """
    folded: dict[tuple[str, Placed], list[int]] = {}
    for fqn, placed in plan.items():
        m = re.match(r"layers\.(\d+)\.(.*)", fqn)
        key = (f"layers.{{}}.{m.group(2)}" if m else fqn, placed)
        folded.setdefault(key, []).append(int(m.group(1)) if m else -1)

    def layer_ranges(ids: list[int]) -> str:
        ids = sorted(ids)
        runs: list[list[int]] = []
        for i in ids:
            if runs and i == runs[-1][1] + 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)

    staged = any(placed.stage for placed in plan.values())
    copied = any(placed.copies_grad for placed in plan.values())
    rows: list[tuple[str, ...]] = [
        ("parameter", "mesh", "placements", "tp_style", "shape", "local", "fsdp", "stage", "copies' gradients")
    ]
    for (name, placed), ids in folded.items():
        if "{}" in name:
            name = name.format(layer_ranges(ids))
        placements = (
            ", ".join(f"{d}:{_fmt_placement(p)}" for d, p in zip(placed.dims, placed.placements, strict=True)) or "-"
        )
        fsdp = "-"
        if placed.fsdp_mesh:
            fsdp = f"shard dim {placed.fsdp_dim} over {placed.fsdp_mesh[-1]}"
            if len(placed.fsdp_mesh) > 1:
                fsdp = f"replicate {placed.fsdp_mesh[0]}; " + fsdp
        local = "x".join(map(str, placed.local_shape(layout))) if layout is not None else ""
        rows.append(
            (
                name,
                placed.mesh,
                placements,
                placed.tp_style or "-",
                "x".join(map(str, placed.shape)),
                local,
                fsdp,
                str(placed.stage),
                f"summed over {' x '.join(placed.copies_grad)}" if placed.copies_grad else "-",
            )
        )
    hidden = {5: layout is None, 7: not staged, 8: not copied}
    keep = [i for i in range(len(rows[0])) if not hidden.get(i)]
    rows = [tuple(r[i] for i in keep) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
