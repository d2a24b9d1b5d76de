"""A model's sizes as the planner counts them: parameters by where they live (dense, sharded,
expert), per-layer widths and FLOPs, read from the model built on the meta device."""

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Shard

from titan_fold.models import FLAVORS, Transformer, TransformerArgs
from titan_fold.models.groups import matrix_shape, uses_muon
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.orthogonalize import ns_flops
from titan_fold.parallel.placement import EXPERT, placement_plan


@dataclass
class ModelSizes:
    """Parameter counts read off the trainer's own model and its placement plan."""

    args: TransformerArgs
    name: str
    dim: int
    n_layers: int
    n_moe_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    num_experts: int
    top_k: int
    moe_ffn_dim: int
    shared_ffn_dim: int
    dense_ffn_dim: int
    tp_params_per_layer: dict  # {"moe": n, "dense": n}: parameters TP shards (attention, shared expert, FFN)
    rep_params_per_layer: dict  # norms, router, shared-expert gate: replicated over tp
    expert_params_per_layer: int  # routed experts of one MoE layer
    embedding_params: int
    head_params: int  # output projection + final norm
    total_params: int
    flops_per_token: int  # the trainer's count (6 N_active + causal attention) at seq_len
    flops_per_token_layer: dict  # {"moe": f, "dense": f} at seq_len (forward + backward)
    flops_per_token_head: int
    # Muon (models/groups.py: uses_muon): the parameters of one layer it orthogonalizes outside the
    # routed experts ({"moe": n, "dense": n}, laid out on tp), and one Newton-Schulz step's FLOPs
    # over those matrices and over one MoE layer's routed experts (parallel/orthogonalize.py)
    muon_params_per_layer: dict = field(default_factory=lambda: {"moe": 0, "dense": 0})
    muon_flops_per_layer: dict = field(default_factory=lambda: {"moe": 0, "dense": 0})
    muon_expert_flops_per_layer: int = 0


def resolve_flavor(spec: str) -> tuple[str, str]:
    """ "family/flavor" or a flavor name found in exactly one family."""
    if "/" in spec:
        family, flavor = spec.split("/", 1)
        if family in FLAVORS and flavor in FLAVORS[family]:
            return family, flavor
        raise ValueError(f"unknown model '{spec}'; known: {known_flavors()}")
    hits = [(f, spec) for f in FLAVORS if spec in FLAVORS[f]]
    if len(hits) != 1:
        what = "ambiguous" if hits else "unknown"
        raise ValueError(f"{what} flavor '{spec}' (use family/flavor); known: {known_flavors()}")
    return hits[0]


def known_flavors() -> str:
    return ", ".join(f"{f}/{v}" for f in FLAVORS for v in FLAVORS[f])


def model_sizes(args: TransformerArgs, seq_len: int, name: str = "") -> ModelSizes:
    """Count parameters by role as the placement plan lays them out (meta device: no memory):
    laid out on tp (attention, its Qwen2 biases, shared expert, dense FFN), replicated over tp
    (norms, router, shared-expert gate), routed experts."""
    with torch.device("meta"):
        model = Transformer(args)
    # any layout with tp > 1 names every parameter's tp placement
    plan = placement_plan(args, Layout(2, tp=2))
    # summed over the layers of a kind, then the mean per layer: the layers of a kind differ where
    # their token mixers do (hybrid models: linear and full attention)
    tp_sharded = {"moe": 0, "dense": 0}
    replicated = {"moe": 0, "dense": 0}
    experts = 0
    for fqn, placed in plan.items():
        if not fqn.startswith("layers."):
            continue
        kind = "moe" if args.is_moe_layer(int(fqn.split(".")[1])) else "dense"
        numel = math.prod(placed.shape)
        if placed.mesh == EXPERT:
            experts += numel
        elif any(isinstance(p, Shard) for p in placed.placements):
            tp_sharded[kind] += numel
        else:
            replicated[kind] += numel
    n_moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    count = {"moe": n_moe, "dense": args.n_layers - n_moe}
    tp_sharded = {k: v // max(count[k], 1) for k, v in tp_sharded.items()}
    replicated = {k: v // max(count[k], 1) for k, v in replicated.items()}
    experts //= max(n_moe, 1)
    muon_params, muon_flops, muon_expert_flops = {"moe": 0, "dense": 0}, {"moe": 0, "dense": 0}, 0
    for fqn, p in model.named_parameters():
        if not fqn.startswith("layers.") or not uses_muon(fqn, p):
            continue
        kind = "moe" if args.is_moe_layer(int(fqn.split(".")[1])) else "dense"
        # one unit per expert of a stack; w13 holds two matrices (gate and up) per expert
        units = (p.shape[0] if p.ndim == 3 else 1) * (2 if fqn.endswith(".experts.w13") else 1)
        flops = units * ns_flops(matrix_shape(fqn, p.shape), 1)
        if p.ndim == 3:
            muon_expert_flops += flops
        else:
            muon_params[kind] += p.numel()
            muon_flops[kind] += flops
    muon_params = {k: v // max(count[k], 1) for k, v in muon_params.items()}
    muon_flops = {k: v // max(count[k], 1) for k, v in muon_flops.items()}
    muon_expert_flops //= max(n_moe, 1)
    head = model.output.weight.numel() + model.norm.weight.numel()
    embedding = 0 if args.tie_embeddings else model.tok_embeddings.weight.numel()
    total, flops = args.get_nparams_and_flops(model, seq_len)
    # per layer and token, the mean over the layers (sliding-window layers count their window)
    attention = args.attention_flops([seq_len]) / (seq_len * (args.n_layers + args.mtp_layers))
    m = args.moe
    per_layer = {
        "moe": 6 * (tp_sharded["moe"] + replicated["moe"] + experts * m.top_k // m.num_experts) + attention,
        "dense": 6 * (tp_sharded["dense"] + replicated["dense"]) + attention,
    }
    return ModelSizes(
        args=args,
        name=name,
        dim=args.dim,
        n_layers=args.n_layers,
        n_moe_layers=n_moe,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        vocab=args.vocab_size,
        num_experts=m.num_experts,
        top_k=m.top_k,
        moe_ffn_dim=m.moe_ffn_dim,
        shared_ffn_dim=m.shared_ffn_dim,
        dense_ffn_dim=args.ffn_dim,
        tp_params_per_layer=tp_sharded,
        rep_params_per_layer=replicated,
        expert_params_per_layer=experts,
        embedding_params=embedding,
        head_params=head,
        total_params=total,
        flops_per_token=flops,
        flops_per_token_layer=per_layer,
        flops_per_token_head=6 * head,  # the trainer counts the final norm as active too
        muon_params_per_layer=muon_params,
        muon_flops_per_layer=muon_flops,
        muon_expert_flops_per_layer=muon_expert_flops,
    )
