"""Where every parameter lives: the placement plan as data.

    placement_plan(model_args, layout) -> {parameter FQN: Placed}

Attention, dense FFN, shared expert, router, norms, embedding and output head live on the
attention mesh and are laid out on its `tp` dim; routed experts live on the expert mesh,
laid out on `ep` x `etp`. The data-parallel dims each parameter is FSDP2-sharded (or, for
dp_replicate, replicated) over are recorded next to them. Degree-1 dims are left out, so an
entry with no dims is a plain (unsharded) tensor there. The parallelize step applies this
plan (attention.apply_tp for the tp entries) and tests read it; `format_plan` prints it.

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
- norms (Qwen3's q/k norms too: each tp rank normalizes its own heads), router gate,
  shared_expert_gate, wo's bias: `Replicate` on tp. Under sequence parallelism each
  tp rank feeds them different tokens, so their gradients are partial sums that are
  reduced over tp (attention.apply_tp makes that explicit).
- routed experts [E, ffn, dim] / [E, dim, ffn]: `Shard(0)` (experts) on ep, the ffn dim on etp.
- FSDP2: dense parameters over dp_shard x cp (cp ranks hold different tokens of the same
  sequences, so their gradients are summed like data parallel ones), replicated over
  dp_replicate (HSDP); experts over edp on dim 0, or on their hidden dim when there are
  fewer local experts than edp ranks (E/ep < edp), so every edp rank holds a real shard.
"""

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from titan_fold.parallel.mesh import Layout

ATTENTION, EXPERT = "attention", "expert"


@dataclass(frozen=True)
class Placed:
    mesh: str  # "attention" or "expert": the mesh every dim below belongs to
    dims: tuple[str, ...]  # model-parallel dims of degree > 1 the tensor is laid out on
    placements: tuple[Placement, ...]  # one per entry of dims
    shape: tuple[int, ...]  # global shape
    fsdp_replicate: tuple[str, ...] = ()  # HSDP replicate dims (degree > 1)
    fsdp_shard: tuple[str, ...] = ()  # dims FSDP2 shards over, flattened (degree > 1); () = no FSDP
    fsdp_dim: int = 0  # tensor dim FSDP2 shards

    def local_shape(self, layout: Layout) -> tuple[int, ...]:
        """Shape of this rank's piece after the model-parallel placements (before FSDP)."""
        shape = list(self.shape)
        for dim, placement in zip(self.dims, self.placements):
            if isinstance(placement, Shard):
                shape[placement.dim] = -(-shape[placement.dim] // layout.size(dim))
        return tuple(shape)


# parameter-name suffix -> tp placement of attention-mesh parameters
_TP_RULES = {
    "tok_embeddings.weight": Shard(0),
    "output.weight": Shard(0),
    "attention.wq.weight": Shard(0),
    "attention.wk.weight": Shard(0),
    "attention.wv.weight": Shard(0),
    "attention.wq.bias": Shard(0),
    "attention.wk.bias": Shard(0),
    "attention.wv.bias": Shard(0),
    "attention.wo.weight": Shard(1),
    "attention.wo.bias": Replicate(),  # added once, after the rowwise reduction
    # Qwen3's per-head q/k norms: one [head_dim] weight, applied to this rank's heads
    "attention.q_norm.weight": Replicate(),
    "attention.k_norm.weight": Replicate(),
    "feed_forward.w1.weight": Shard(0),
    "feed_forward.w3.weight": Shard(0),
    "feed_forward.w2.weight": Shard(1),
    "shared_expert.w1.weight": Shard(0),
    "shared_expert.w3.weight": Shard(0),
    "shared_expert.w2.weight": Shard(1),
    "router.gate.weight": Replicate(),
    "shared_expert_gate.weight": Replicate(),
    "attention_norm.weight": Replicate(),
    "ffn_norm.weight": Replicate(),
    "norm.weight": Replicate(),
}
# routed experts: (ep placement, etp placement); the etp one is each tensor's ffn dim
_EXPERT_RULES = {
    "experts.w1": (Shard(0), Shard(1)),  # [E, ffn, dim]
    "experts.w3": (Shard(0), Shard(1)),  # [E, ffn, dim]
    "experts.w2": (Shard(0), Shard(2)),  # [E, dim, ffn]
}
# hidden (dim) axis of each expert tensor: FSDP's shard dim when E/ep < edp
_EXPERT_HIDDEN_DIM = {"experts.w1": 2, "experts.w3": 2, "experts.w2": 1}


def expert_placements(name: str, dims) -> tuple[Placement, ...]:
    """Placements of the stacked experts.<name> (w1, w2, w3) on mesh dims among "ep", "etp"."""
    by_dim = dict(zip(("ep", "etp"), _EXPERT_RULES[f"experts.{name}"]))
    return tuple(by_dim[d] for d in dims)


def _rule(fqn: str, rules: dict):
    # longest matching suffix on a dot boundary ("norm.weight" must not catch "ffn_norm.weight")
    for suffix in sorted(rules, key=len, reverse=True):
        if fqn == suffix or fqn.endswith("." + suffix):
            return suffix
    return None


def placement_plan(model_args, layout: Layout) -> dict[str, Placed]:
    """{FQN: Placed} for every parameter of `Transformer(model_args)` under `layout`.

    The FQNs are read off a model built on the meta device (no memory), so they are exactly
    the model's `named_parameters()` (a tied output head appears once, as tok_embeddings).
    """
    from titan_fold.models import Transformer

    with torch.device("meta"):
        model = Transformer(model_args)
    on = lambda *names: tuple(n for n in names if layout.size(n) > 1)  # noqa: E731
    dense_fsdp = dict(fsdp_replicate=on("dp_replicate"), fsdp_shard=on("dp_shard", "cp"))
    experts_per_rank = model_args.moe.num_experts // layout.ep
    plan = {}
    for fqn, param in model.named_parameters():
        shape = tuple(param.shape)
        expert = _rule(fqn, _EXPERT_RULES)
        if expert is not None:
            dims = on("ep", "etp")
            fsdp_dim = _EXPERT_HIDDEN_DIM[expert] if experts_per_rank < layout.edp else 0
            plan[fqn] = Placed(
                EXPERT, dims, expert_placements(expert.removeprefix("experts."), dims), shape, (), on("edp"), fsdp_dim
            )
            continue
        suffix = _rule(fqn, _TP_RULES)
        if suffix is None:
            raise KeyError(f"no placement rule for parameter {fqn!r}: add one to titan_fold/parallel/placement.py")
        dims = on("tp")
        plan[fqn] = Placed(ATTENTION, dims, tuple(_TP_RULES[suffix] for _ in dims), shape, **dense_fsdp)
    return plan


def _fmt_placement(p: Placement) -> str:
    return f"Shard({p.dim})" if isinstance(p, Shard) else type(p).__name__


def format_plan(plan: dict[str, Placed], layout: Layout | None = None) -> str:
    """One line per distinct parameter; blocks with identical entries are folded into a range.

    With a layout, each line also shows the per-rank shape after tp / ep / etp (before FSDP).
    """
    import re

    folded: dict[tuple[str, Placed], list[int]] = {}
    for fqn, placed in plan.items():
        m = re.match(r"layers\.(\d+)\.(.*)", fqn)
        key = (f"layers.{{}}.{m.group(2)}" if m else fqn, placed)
        folded.setdefault(key, []).append(int(m.group(1)) if m else -1)

    def layer_ranges(ids: list[int]) -> str:
        ids, runs = sorted(ids), []
        for i in ids:
            if runs and i == runs[-1][1] + 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)

    rows = [("parameter", "mesh", "placements", "shape", "local", "fsdp")]
    for (name, placed), ids in folded.items():
        if "{}" in name:
            name = name.format(layer_ranges(ids))
        placements = ", ".join(f"{d}:{_fmt_placement(p)}" for d, p in zip(placed.dims, placed.placements)) or "-"
        fsdp = "-"
        if placed.fsdp_shard or placed.fsdp_replicate:
            parts = []
            if placed.fsdp_replicate:
                parts.append("replicate " + " x ".join(placed.fsdp_replicate))
            if placed.fsdp_shard:
                parts.append(f"shard dim {placed.fsdp_dim} over " + " x ".join(placed.fsdp_shard))
            fsdp = "; ".join(parts)
        local = "x".join(map(str, placed.local_shape(layout))) if layout is not None else ""
        rows.append((name, placed.mesh, placements, "x".join(map(str, placed.shape)), local, fsdp))
    if layout is None:
        rows = [r[:4] + r[5:] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
