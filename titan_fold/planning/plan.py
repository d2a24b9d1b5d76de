"""`python -m titan_fold.plan`: rank the folded parallel mappings of a model on a cluster.

    python -m titan_fold.plan --model qwen2_moe/57B-A14B --gpus 64 --gpus-per-node 8 \\
        --gpu-memory-gib 80 --seq-len 4096 --global-batch 256 --top 5

Every degree set the trainer's Layout validation accepts is tried with each recompute
choice (none, selective, full); one sequence per micro-batch. The model behind the numbers
is titan_fold.planning.cost_model (docs/planning.md). `--min-gpus cp=8 ep=8` instead prints the fewest
GPUs that hold those degrees with and without folding.
"""

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from dataclasses import asdict

from titan_fold.common.errors import UserError
from titan_fold.models import FLAVORS
from titan_fold.planning.cost_model import GIB, Cluster, Estimate, Workload, estimate
from titan_fold.planning.load import LoadProfile, copies_comm, imbalance, read_profile
from titan_fold.planning.search import at, enumerate_mappings, job_toml, min_gpus, plan
from titan_fold.planning.sizes import model_sizes, resolve_flavor

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp", "edp")
# seconds --min-gpus searches before it gives up (it prints its progress meanwhile)
MIN_GPUS_BUDGET_S = 60.0


class PlanError(UserError):
    pass


def parse_degrees(option: str, items: list[str]) -> dict[str, int]:
    """["ep=8", "cp=2"] -> {"ep": 8, "cp": 2}; anything else is one line naming the item."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not value.strip().isdigit():
            raise PlanError(f"{option} {item}: write DIM=N with N >= 1, e.g. ep=8 (dims: {', '.join(DIMS)})")
        if name not in DIMS:
            raise PlanError(f"{option} {item}: unknown dim '{name}' (dims: {', '.join(DIMS)})")
        if int(value) < 1:
            raise PlanError(f"{option} {item}: the degree must be >= 1")
        out[name] = int(value)
    return out


def check_args(args: argparse.Namespace) -> None:
    """Numbers that no cluster or workload can have."""
    for name in ("gpus", "gpus_per_node", "seq_len", "global_batch", "top"):
        if getattr(args, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    gpus, per_node = args.gpus, args.gpus_per_node
    if gpus > per_node and gpus % per_node:
        # the cost model places rank r on node r // gpus_per_node: every node but a single one is full
        whole = gpus - gpus % per_node
        raise PlanError(
            f"--gpus {gpus}: must be whole nodes of --gpus-per-node {per_node} ({whole} or {whole + per_node}), "
            "or one node at most"
        )
    for name in ("gpu_memory_gib", "intra_node_gbps", "inter_node_gbps", "tflops", "gemm_half_rows"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise PlanError(f"--{name.replace('_', '-')} {value}: must be > 0")
    for name in ("compute_efficiency", "comm_efficiency"):
        value = getattr(args, name)
        if not 0 < value <= 1:
            raise PlanError(f"--{name.replace('_', '-')} {value}: must be in (0, 1]")
    if not (math.isfinite(args.reserve_gib) and 0 <= args.reserve_gib < args.gpu_memory_gib):
        raise PlanError(f"--reserve-gib {args.reserve_gib}: must be >= 0 and below --gpu-memory-gib")
    cf = args.capacity_factor
    if cf is not None and not (math.isfinite(cf) and cf > 0):
        raise PlanError(f"--capacity-factor {cf}: must be > 0 (leave it out for dropless)")


class _Progress:
    """--min-gpus: a line on stderr every few seconds, and a stop after the budget."""

    def __init__(self, what: str, budget_s: float):
        self.what, self.start, self.budget_s, self.last = what, time.monotonic(), budget_s, time.monotonic()

    def __call__(self, gpus: int) -> None:
        now = time.monotonic()
        if now - self.start > self.budget_s:
            raise PlanError(
                f"--min-gpus {self.what}: no mapping found up to {gpus} GPUs within {self.budget_s:.0f} s; "
                "check that the degrees divide the model's sizes (layout --model checks one set)"
            )
        if now - self.last > 5:
            print(f"searching {self.what}: {gpus} GPUs ...", file=sys.stderr, flush=True)
            self.last = now


def _row(rank: int | str, e: Estimate) -> str:
    m = e.mapping
    return (
        f"{rank:>4}  {m.pp:>2} {m.dp_replicate:>3}x{m.dp_shard:<3} {m.cp:>2} {m.tp:>2} | {m.ep:>3} {m.etp:>3} {m.edp:>3}"
        f"  {m.recompute:<9} {'yes' if m.folded else 'no':<6} {e.memory.total / GIB:>6.1f} {e.headroom_gib:>6.1f}"
        f" {e.memory.total_worst_dropless / GIB:>7.1f} {e.step_s:>7.2f} {100 * e.mfu:>5.1f}%  {e.reasons[0]}; {e.reasons[2]}"
    )


HEADER = (
    f"{'rank':>4}  {'pp':>2} {'dp r x s':>7} {'cp':>2} {'tp':>2} | {'ep':>3} {'etp':>3} {'edp':>3}  {'recompute':<9} "
    f"{'folded':<6} {'GiB':>6} {'free':>6} {'worst':>7} {'step s':>7} {'MFU':>6}  reasons"
)


def _as_dict(e: Estimate) -> dict:
    return {
        "mapping": asdict(e.mapping),
        "folded": e.mapping.folded,
        "legacy_groups": e.legacy_groups,
        "memory_gib": e.memory.gib(),
        "headroom_gib": e.headroom_gib,
        "fits": e.fits,
        "step_s": e.step_s,
        "mfu": e.mfu,
        "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
        "compute_s_per_microbatch": e.compute_s,
        "exposed_comm_s_per_microbatch": e.exposed_comm_s,
        "exposed_fsdp_s": e.exposed_fsdp_s,
        "bubble_s": e.bubble_s,
        "dominant": e.dominant,
        "comm": {
            n: {
                "bytes_per_step": c.bytes_per_step,
                "seconds": c.seconds,
                "crossing": c.crossing,
                "groups": c.groups,
                "overlapped": c.overlapped,
            }
            for n, c in e.comm.items()
        },
        "reasons": e.reasons,
    }


def given_mappings(
    specs: list[str], sizes, work: Workload, cluster: Cluster, recompute, by_ep=None
) -> list[tuple[str, Estimate]]:
    """Estimates of user-named mappings: (label, estimate), the fastest recompute choice that fits."""
    out = []
    for spec in specs:
        fixed = parse_degrees("--mapping", [kv for kv in spec.replace(" ", ",").split(",") if kv])
        fixed.setdefault("dp_replicate", 1)
        for k in ("cp", "tp", "ep", "etp", "pp"):
            fixed.setdefault(k, 1)
        found = enumerate_mappings(cluster.gpus, sizes, work.seq_len, fixed)
        if not found:
            raise PlanError(f"--mapping {spec}: not a valid mapping on {cluster.gpus} GPUs")
        for legacy in (False, True) if not found[0].folded else (False,):
            ests = [
                estimate(sizes, m, at(work, m, by_ep), cluster, True, legacy)
                for m in (dataclasses.replace(found[0], recompute=rc) for rc in recompute)
            ]
            fit = [e for e in ests if e.fits] or [min(ests, key=lambda e: e.memory.total)]
            out.append(("lgcy" if legacy else "given", min(fit, key=lambda e: e.step_s)))
    return out


def measured_load(
    profile: LoadProfile, R: int, shown: list[tuple[int | str, Estimate]], sizes, work: Workload, cluster: Cluster
) -> list[dict]:
    """--load-profile: for each shown mapping (its table label, its estimate under the profile's
    imbalance), the imbalance and step time without and with R hot-expert copies. With copies:
    the estimate at the copies' imbalance, plus their all-reduces (load.copies_comm) in every
    pipeline slot of the step."""
    out = []
    for label, e in shown:
        m = e.mapping
        even = imbalance(profile.counts, m.ep, R)
        copies = estimate(sizes, m, dataclasses.replace(work, dropless_imbalance=even), cluster, True, e.legacy_groups)
        comm = copies_comm(sizes, m, work, cluster, copies, R)
        out.append(
            {
                "label": label,
                "mapping": asdict(m),
                "ep": m.ep,
                "imbalance": imbalance(profile.counts, m.ep, 0),
                "imbalance_copies": even,
                "step_s": e.step_s,
                "copies_comm_s_per_microbatch": comm,
                "step_s_copies": copies.step_s + (work.microbatches(m.dp) + m.pp - 1) * comm,
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    """`python -m titan_fold.plan`'s work, its options parsed (options.plan_parser)."""
    check_args(args)
    fixed = parse_degrees("--fix", args.fix)
    try:
        family, flavor = resolve_flavor(args.model)
    except ValueError as err:
        raise PlanError(f"--model: {err}") from None
    sizes = model_sizes(FLAVORS[family][flavor], args.seq_len, f"{family}/{flavor}")
    profile, by_ep = None, None
    R = args.hot_expert_replicas
    if not 0 <= R <= sizes.num_experts:
        raise PlanError(f"--hot-expert-replicas {R}: must be in [0, {sizes.num_experts}] (the model's experts)")
    if R and not args.load_profile:
        raise PlanError(f"--hot-expert-replicas {R}: needs --load-profile (the load the copies even out)")
    if args.load_profile:
        try:
            profile = read_profile(args.load_profile, sizes.num_experts, sizes.n_moe_layers)
        except ValueError as err:
            raise PlanError(str(err)) from None
        counts = profile.counts
        by_ep = functools.cache(lambda ep: imbalance(counts, ep, 0))

    if args.min_gpus:
        wanted = parse_degrees("--min-gpus", args.min_gpus)
        progress = _Progress(" ".join(args.min_gpus), MIN_GPUS_BUDGET_S)
        fewest = {}
        for folded in (True, False):
            found = min_gpus(sizes, args.seq_len, wanted, folded, progress=progress)
            fewest["folded" if folded else "legacy"] = (
                {"gpus": found[0], "mapping": found[1].short()} if found else None
            )
        if args.format == "json":
            print(json.dumps(fewest))
        else:
            want = " ".join(args.min_gpus)
            for k, v in fewest.items():
                print(f"{k:<7} {want}: " + (f"{v['gpus']} GPUs  ({v['mapping']})" if v else "none up to 4096 GPUs"))
        return 0

    cluster = Cluster(
        args.gpus,
        args.gpus_per_node,
        args.gpu_memory_gib,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
        tflops=args.tflops,
        compute_efficiency=args.compute_efficiency,
        gemm_half_rows=args.gemm_half_rows,
        comm_efficiency=args.comm_efficiency,
        reserve_gib=args.reserve_gib,
    )
    work = Workload(args.seq_len, args.global_batch, args.capacity_factor, optimizer=args.optimizer)
    result = plan(sizes, work, cluster, args.top, tuple(args.recompute), fixed, by_ep)
    best, legacy = (result.ranked[0] if result.ranked else None), result.best_legacy
    given = given_mappings(args.mapping, sizes, work, cluster, tuple(args.recompute), by_ep)
    shown: list[tuple[int | str, Estimate]] = [
        *enumerate(result.ranked, 1),
        *([("lgcy", legacy)] if legacy else []),
        *given,
    ]
    loads = measured_load(profile, R, shown, sizes, work, cluster) if profile else None

    if args.format == "json":
        report = {
            "model": sizes.name,
            "cluster": asdict(cluster),
            "workload": asdict(work),
            "candidates": result.candidates,
            "rejected": result.rejected,
            "ranked": [_as_dict(e) for e in result.ranked],
            "best_legacy": _as_dict(legacy) if legacy else None,
            "given": [{"label": label, **_as_dict(e)} for label, e in given],
        }
        if profile and loads is not None:
            report["load_profile"] = {
                "file": profile.path,
                "step": profile.step,
                "hot_expert_replicas": R,
                "mappings": loads,
            }
        print(json.dumps(report, indent=1))
    else:
        nodes = -(-args.gpus // args.gpus_per_node)
        print(
            f"{sizes.name}: {sizes.total_params / 1e9:.1f}B params, {sizes.flops_per_token / 1e9:.1f} GFLOP/token "
            f"at seq {args.seq_len}; {args.gpus} GPUs ({nodes} node(s) x {args.gpus_per_node}), "
            f"{args.gpu_memory_gib:g} GiB, {args.intra_node_gbps:g}/{args.inter_node_gbps:g} GB/s, "
            f"{args.tflops:g} TFLOP/s x {args.compute_efficiency:g}; global batch {args.global_batch} "
            + ("dropless" if args.capacity_factor is None else f"capacity factor {args.capacity_factor:g}")
            + ("" if args.optimizer == "AdamW" else f"; {args.optimizer}")
        )
        print(
            f"{result.candidates} candidates (degree sets x recompute); rejected: "
            + ", ".join(f"{k} {v}" for k, v in result.rejected.items())
        )
        print(HEADER)
        for i, e in enumerate(result.ranked, 1):
            print(_row(i, e))
        if legacy:
            print(_row("lgcy", legacy))
            if best:
                print(
                    f"best: {best.mapping.short()} {best.mapping.recompute}: {best.step_s:.2f} s/step, "
                    f"{best.tokens_per_s_per_gpu:.0f} tokens/s/GPU; best unfolded (legacy group order): "
                    f"{legacy.mapping.short()} {legacy.mapping.recompute}: {legacy.step_s:.2f} s/step; "
                    f"expected gain {legacy.step_s / best.step_s:.2f}x"
                )
        elif best:
            print("no unfolded (legacy) mapping fits")
        if not best:
            print("no mapping fits in memory")
        if given:
            print("given mappings ('lgcy': legacy group order):")
            for label, e in given:
                print(_row(label, e))
        if profile and loads is not None:
            print(
                f"measured load ({profile.path}, step {profile.step}): busiest ep rank's routed rows / mean, "
                f"and step time, without / with {R} hot-expert replicas"
            )
            print(f"{'rank':>5}  {'ep':>3}  {'imbalance':>9} {'copies':>7}  {'step s':>10} {'copies':>10}")
            for r in loads:
                print(
                    f"{r['label']:>5}  {r['ep']:>3}  {r['imbalance']:>9.3f} {r['imbalance_copies']:>7.3f}"
                    f"  {r['step_s']:>10.4g} {r['step_s_copies']:>10.4g}"
                )
    if args.placements and best:
        from titan_fold.parallel.placement import format_plan, placement_plan

        layout = best.mapping.layout()
        print(f"placements under {best.mapping.short()}:")
        print(format_plan(placement_plan(sizes.args, layout), layout))
    if args.write_config:
        if not best:
            return 1
        try:
            with open(args.write_config, "w") as f:
                f.write(job_toml(family, flavor, best.mapping, work))
        except OSError as e:
            raise PlanError(f"--write-config: cannot write {args.write_config}: {e.strerror or e}") from None
        print(f"wrote {args.write_config}", file=sys.stderr)
    return 0 if best or args.min_gpus else 1
