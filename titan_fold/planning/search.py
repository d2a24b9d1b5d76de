"""The search over folded mappings: every valid degree set, the fewest GPUs for given degrees, the ranking by
estimated step time, and the job config of a chosen mapping."""

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from titan_fold.parallel.mesh import Layout, LayoutError, divisors
from titan_fold.planning.cost_model import GIB, Cluster, Estimate, Mapping, Workload, estimate, memory
from titan_fold.planning.options import RECOMPUTE
from titan_fold.planning.sizes import ModelSizes


def enumerate_mappings(world: int, sizes: ModelSizes, seq_len: int, fixed: dict | None = None) -> list[Mapping]:
    """Every degree set the trainer's Layout validation accepts for this model (recompute 'none').

    The loops only propose degrees whose products fill the world; whether a proposal is
    valid is decided by `Layout(...).validate(...)`, the trainer's own check.
    """
    fixed = fixed or {}
    ok = lambda name, v: fixed.get(name, v) == v  # noqa: E731
    out = []
    for pp in divisors(world):
        if not ok("pp", pp):
            continue
        s = world // pp
        for tp in divisors(s):
            for cp in divisors(s // tp):
                for dpr in divisors(s // (tp * cp)):
                    dps = s // (tp * cp * dpr)
                    if not (ok("tp", tp) and ok("cp", cp) and ok("dp_replicate", dpr) and ok("dp_shard", dps)):
                        continue
                    for ep in divisors(s):
                        for etp in divisors(s // ep):
                            if not (ok("ep", ep) and ok("etp", etp)):
                                continue
                            try:
                                lay = Layout(
                                    world,
                                    pp=pp,
                                    dp_replicate=dpr,
                                    dp_shard=dps,
                                    cp=cp,
                                    tp=tp,
                                    ep=ep,
                                    etp=etp,
                                    hints=False,
                                )
                                lay.validate_model(sizes.args, seq_len)
                            except LayoutError:
                                continue
                            out.append(Mapping(pp, dpr, dps, cp, tp, ep, etp, lay.edp))
    return out


def min_gpus(
    sizes: ModelSizes, seq_len: int, fixed: dict, folded: bool, limit: int = 4096, progress=None
) -> tuple[int, Mapping] | None:
    """Fewest GPUs with a valid mapping that has the `fixed` degrees (legacy scheme if not folded).

    Every degree divides the world, so only multiples of their lcm are tried; `progress(n)`
    is called as the search passes each world size (it may raise to stop the search)."""
    step = math.lcm(*fixed.values()) if fixed else 1
    for n in range(step, limit + 1, step):
        if progress is not None:
            progress(n)
        for m in enumerate_mappings(n, sizes, seq_len, fixed):
            if folded or not m.folded:
                return n, m
    return None


@dataclass
class Plan:
    ranked: list  # Estimates that fit, best first (top K)
    best_legacy: Estimate | None  # best mapping the legacy (unfolded) scheme can express, legacy groups
    candidates: int  # degree sets x recompute choices considered
    rejected: dict  # reason -> count


def at(work: Workload, m: Mapping, imbalance: Callable[[int], float] | None) -> Workload:
    """The workload of mapping m: its dropless imbalance from `imbalance(m.ep)` when given."""
    return work if imbalance is None else replace(work, dropless_imbalance=imbalance(m.ep))


def plan(
    sizes: ModelSizes,
    work: Workload,
    cluster: Cluster,
    top: int = 5,
    recompute: tuple = RECOMPUTE,
    fixed: dict | None = None,
    imbalance: Callable[[int], float] | None = None,
) -> Plan:
    """Rank every valid mapping (with the `fixed` degrees) by estimated step time.

    Exact for the top K and the best legacy mapping.

    Branch and bound: the estimate with every group inside a node is a lower bound (inter-node
    links are the slower ones), so candidates are evaluated with their real group membership
    in order of that bound until the bound exceeds the K-th best time found.

    imbalance(ep): each mapping's `Workload.dropless_imbalance` (a measured load profile), if given.
    """
    rejected = {"global batch % dp != 0": 0, "pp > n_layers": 0, "out of memory": 0}
    capacity = (cluster.gpu_memory_gib - cluster.reserve_gib) * GIB
    bounds = []
    degree_sets = enumerate_mappings(cluster.gpus, sizes, work.seq_len, fixed)
    for d in degree_sets:
        if work.global_batch % d.dp:
            rejected["global batch % dp != 0"] += 1
            continue
        if d.pp > sizes.n_layers:
            rejected["pp > n_layers"] += 1
            continue
        for rc in recompute:
            m = replace(d, recompute=rc)
            mem = memory(sizes, m, at(work, m, imbalance))
            if mem.total > capacity:
                rejected["out of memory"] += 1
                continue
            bounds.append(estimate(sizes, m, at(work, m, imbalance), cluster, groups=False, mem=mem))
    bounds.sort(key=lambda e: e.step_s)

    def best_of(cands, k, legacy):
        exact: list[Estimate] = []
        for lb in cands:
            if len(exact) >= k and lb.step_s > exact[k - 1].step_s:
                break
            e = estimate(sizes, lb.mapping, at(work, lb.mapping, imbalance), cluster, True, legacy, lb.memory)
            bisect.insort(exact, e, key=lambda e: (e.step_s, -e.headroom_gib))  # after equal keys, as a stable sort
        return exact[:k]

    legacy = best_of([b for b in bounds if not b.mapping.folded], 1, True)
    return Plan(best_of(bounds, top, False), legacy[0] if legacy else None, len(degree_sets) * len(recompute), rejected)


def job_toml(family: str, flavor: str, m: Mapping, work: Workload) -> str:
    """A job config for `titan_fold.train` (parses with titan_fold.common.config.parse_args)."""
    # PP: the rank's whole batch, cut into micro-batches by the schedule; otherwise one
    # micro-batch per forward/backward and gradient accumulation over global / (local x dp)
    local = work.global_batch // m.dp if m.pp > 1 else work.micro_batch
    ac = {
        "none": 'mode = "none"',
        "selective": 'mode = "selective"\nselective_ac_option = "op"',
        "full": 'mode = "full"',
    }
    lines = [
        f"# written by `python -m titan_fold.plan`: {m.short()}, recompute {m.recompute}"
        + (" (folded)" if m.folded else ""),
        "[job]",
        f'dump_folder = "./outputs/{family}_{flavor}"',
        "",
        "[model]",
        f'name = "{family}"',
        f'flavor = "{flavor}"',
        "",
        "[training]",
        f"seq_len = {work.seq_len}",
        f"global_batch_size = {work.global_batch}",
        f"local_batch_size = {local}",
        "",
        "[parallelism]",
        f"pipeline_parallel_degree = {m.pp}",
        f"data_parallel_replicate_degree = {m.dp_replicate}",
        f"data_parallel_shard_degree = {m.dp_shard}",
        f"context_parallel_degree = {m.cp}",
        f"tensor_parallel_degree = {m.tp}",
        f"expert_parallel_degree = {m.ep}",
        f"expert_tensor_parallel_degree = {m.etp}",
        f"expert_data_parallel_degree = {m.edp}",
    ]
    if m.pp > 1:  # the stage stays gathered through the step (what the planner's estimate assumes)
        lines += [f"pipeline_parallel_microbatch_size = {work.micro_batch}", 'fsdp_reshard_after_forward = "never"']
    lines += ["", "[activation_checkpoint]", ac[m.recompute]]
    if work.capacity_factor is not None:
        lines += ["", "[moe]", f"capacity_factor = {work.capacity_factor}"]
    return "\n".join(lines) + "\n"
