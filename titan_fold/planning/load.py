"""Measured expert load in the planner: `python -m titan_fold.plan --load-profile expert_load.jsonl
[--hot-expert-replicas R]`.

The profile is the last record of a run's expert_load.jsonl (`--metrics.expert_load`): rows per
expert [layers][E]. Under a mapping the ep ranks hold contiguous blocks of E / ep experts (the
trainer's placement), so a rank's routed rows are its block's sum; `imbalance` turns that into
`Workload.dropless_imbalance`. With R hot-expert replicas (`moe.hot_expert_replicas`) the
trainer's own device planner (titan_fold/moe/replicas.py) nominates the R busiest experts of a
layer and water-fills their rows over the ep ranks; its copies cost an all-reduce of their
weights forward and of their gradients backward (`copies_comm`).
"""

import json
from dataclasses import dataclass

from titan_fold.planning.cost_model import Cluster, Estimate, GroupComm, Mapping, Workload, _layers_per_stage, _seconds
from titan_fold.planning.sizes import ModelSizes


@dataclass
class LoadProfile:
    path: str
    step: int
    layers: list[str]
    counts: list[list[int]]  # [layers][E] rows per expert


def read_profile(path: str, num_experts: int, moe_layers: int) -> LoadProfile:
    """The last record of an expert_load.jsonl, checked against the model; anything else is a
    ValueError of one line."""
    where = f"--load-profile {path}"
    try:
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    if not lines:
        raise ValueError(f"{where}: the file is empty (expected expert_load.jsonl's records)")
    try:
        rec = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: the last line is not JSON ({e.msg})") from None
    shape = '{"step": N, "layers": [names], "counts": [[rows per expert] per layer]}'
    ok = (
        isinstance(rec, dict)
        and isinstance(rec.get("step"), int)
        and isinstance(rec.get("layers"), list)
        and all(isinstance(n, str) for n in rec["layers"])
        and isinstance(rec.get("counts"), list)
        and len(rec["counts"]) == len(rec["layers"])
        and all(isinstance(row, list) for row in rec["counts"])
        and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for row in rec["counts"] for c in row)
    )
    if not ok:
        raise ValueError(f"{where}: the last line is not a record {shape} with counts >= 0")
    counts = rec["counts"]
    if len(counts) != moe_layers:
        raise ValueError(f"{where}: {len(counts)} layers, the model has {moe_layers} MoE layers")
    for name, row in zip(rec["layers"], counts, strict=True):
        if len(row) != num_experts:
            raise ValueError(f"{where}: {name} has {len(row)} experts, the model has {num_experts}")
        if not sum(row):
            raise ValueError(f"{where}: {name} routed no rows")
    return LoadProfile(path, rec["step"], rec["layers"], counts)


def rank_loads(counts: list[int], ep: int, R: int) -> list[int]:
    """counts [E] rows per expert -> rows per ep rank [ep]: each rank's block of E / ep experts,
    or with R > 0 the rows of its non-nominated experts plus its water-filled share of the
    nominees' rows (replicas.nominate, replicas.water_fill)."""
    import torch

    from titan_fold.moe.replicas import nominate, water_fill

    totals = torch.tensor(counts, dtype=torch.int64)  # [E]
    load = totals.view(ep, -1).sum(1)  # [ep]
    if R == 0:
        return load.tolist()
    nominees = nominate(totals, R)  # [R]
    moving = totals[nominees]  # [R]
    # the fill may leave room past the last nominee row: the stream of rows ends at their sum
    cap_ends = water_fill(totals, nominees, ep).clamp(max=moving.sum())  # [ep]
    E_loc = totals.numel() // ep
    base = load - torch.zeros_like(load).index_add(0, nominees // E_loc, moving)  # [ep]
    return (base + cap_ends.diff(prepend=cap_ends.new_zeros(1))).tolist()


def imbalance(counts: list[list[int]], ep: int, R: int) -> float:
    """counts [layers][E] -> the mean over layers of the busiest ep rank's rows over the mean
    rank's (1.0: balanced), with R hot-expert copies when R > 0."""
    ratios = []
    for row in counts:
        loads = rank_loads(row, ep, R)
        ratios.append(max(loads) * ep / sum(loads))
    return sum(ratios) / len(ratios)


def copies_comm(sizes: ModelSizes, m: Mapping, work: Workload, cluster: Cluster, est: Estimate, R: int) -> float:
    """Seconds per micro-batch the copies add on the critical path of the busiest stage: per MoE
    layer a ring all-reduce over ep of R experts' weights (this rank's etp shard) forward and of
    their gradients backward, in the compute dtype; full recompute repeats the forward one. The
    ep group's node crossing is the one `est` (this mapping's estimate) found for the exchange."""
    if R == 0 or m.ep == 1:
        return 0.0
    shard = R * sizes.expert_params_per_layer / sizes.num_experts / m.etp * work.compute_bytes
    passes = 3 if m.recompute == "full" else 2
    sent = _layers_per_stage(sizes, m.pp)["moe"] * passes * 2 * shard * (m.ep - 1) / m.ep
    c = GroupComm("ep copies", sent, "ring", False, m.ep)
    c.crossing, c.inter_fraction, c.groups = (
        est.comm["ep"].crossing,
        est.comm["ep"].inter_fraction,
        est.comm["ep"].groups,
    )
    return _seconds(c, cluster)
