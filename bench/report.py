"""docs/benchmarks.md's tables from the suite results: `python -m bench.report`.

Reads bench/results/<suite>_<gpu>_<date>[_<HHMM>].json (written by `python -m bench SUITE`) and
prints the fine-grained MoE goals (GOALS) with the latest and the best recorded figure of each on
each GPU, then, per suite and machine, the tables of each file holding the latest figures of some step,
and where the suite ran twice there, the latest run's figures beside the run before's (each within
3% or not); after the loss-curve suite's records, every recorded run of each of its steps pooled
over records and machines. `--write` puts them into docs/benchmarks/results.md, and the goals, the
MFU counts and a list of each suite's latest record (summary()) into docs/benchmarks.md, each
between its two REPORT markers.
"""

import argparse
import functools
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DOC = os.path.join(os.path.dirname(HERE), "docs", "benchmarks.md")
FULL = os.path.join(os.path.dirname(HERE), "docs", "benchmarks", "results.md")  # every record's tables
RL_DOC = os.path.join(os.path.dirname(HERE), "docs", "rl.md")  # the rl suite's table
BEGIN, END = "<!-- REPORT BEGIN: python -m bench.report --write -->", "<!-- REPORT END -->"
SUITE_ORDER = (
    "layer",
    "trainer",
    "vs-torchtitan",
    "deepseek-v3",
    "families",
    "full-depth",
    "loss-curve",
    "kernels",
    "2gpu",
)
TOLERANCE = 0.03  # a rerun of a suite on the same kind of machine reproduces each figure within this share


def _f(x, digits=1):
    return "n/a" if x is None else f"{x:,.{digits}f}"


def records(results: str) -> dict[tuple, list[dict]]:
    """(suite, machine) -> its records, latest first, keys in SUITE_ORDER, then by machine."""
    by_key = {}
    for path in glob.glob(os.path.join(results, "*.json")):
        with open(path) as f:
            rec = json.load(f)
        if "suite" not in rec:
            continue
        rec["_file"] = os.path.join("bench", "results", os.path.basename(path))
        by_key.setdefault((rec["suite"], rec["env"]["device"], rec["env"]["device_count"]), []).append(rec)
    order = {s: i for i, s in enumerate(SUITE_ORDER)}
    return {
        k: sorted(by_key[k], key=lambda r: r["date_utc"], reverse=True)
        for k in sorted(by_key, key=lambda k: (order.get(k[0], len(order)), k[1], k[2]))
    }


def latest(results: str) -> list[dict]:
    """The latest record of each (suite, machine), in SUITE_ORDER, then by machine."""
    return [recs[0] for recs in records(results).values()]


STEADY = 1.05  # a timed row whose median lies within this factor of its fastest repeat


def _row_kind(r: dict) -> str:
    """Which script wrote a row: "gemms" (bench/grouped_gemm.py), "layer" (bench/moe_layer.py),
    "train" (a trainer case), "other"."""
    return "gemms" if "gemms" in r else "layer" if "impl" in r else "train" if "case" in r else "other"


def _gemm_case(r: dict) -> tuple[str, str, str]:
    """A grouped GEMM row's shape, rows per expert and GEMM path (records before --counts and
    --impl hold torch's GEMMs at drawn counts)."""
    return r["shape"], r.get("counts", "drawn"), r.get("impl", "torch")


def _row_label(r: dict) -> str | None:
    """What a row measured: a layer row's shape, mode, dispatch, GEMM path and compile mode, a
    grouped GEMM row's shape, rows per expert and GEMM path, a trainer row's case."""
    kind = _row_kind(r)
    if kind == "gemms":
        return ", ".join(_gemm_case(r))
    if kind == "layer":
        return (
            f"{r['shape']}{'' if r['mode'] == 'dropless' else ' (' + r['mode'] + ')'}, {r['dispatch']}, "
            f"{_gemm_choice(r['impl'])}, {_mode(r['compiled'])}"
        )
    return r.get("case")


def _figures(rec: dict, step: str) -> dict[tuple[str, str], tuple[float, bool]]:
    """(row, figure) -> (value, steady) of one step of a record: each layer row's share of the dense
    GEMM rate (its result: the time over the dense rate measured in the same run, so that a card's
    clock state, which moves both, cancels; and its share of the sustained rate, where recorded)
    and GPU busy ms where profiled, each trainer row's tokens/s per GPU and peak memory, the
    step's dense GEMM rates and copy rate. A layer row is steady when its median time is within
    STEADY of its fastest repeat: a host-bound step (eager, fine-grained shapes) moves with the
    host's other work, and its median does not reproduce; device-timed figures (GPU busy, the
    GEMM and copy rates) are steady."""
    fig, out = rec["figures"].get(step), {}
    if not fig:
        return out
    if fig.get("dense_bf16_gemm_tflops"):
        out[("-", "dense GEMM TFLOP/s")] = (fig["dense_bf16_gemm_tflops"], True)
    if fig.get("dense_bf16_gemm_tflops_sustained"):
        out[("-", "sustained dense GEMM TFLOP/s")] = (fig["dense_bf16_gemm_tflops_sustained"], True)
    if fig.get("copy_tbps"):
        out[("-", "copy TB/s")] = (fig["copy_tbps"], True)
    for r in fig.get("rows", []):
        if _row_kind(r) == "layer" and r.get("ratio_to_dense_gemm"):
            row = _row_label(r)
            steady = not r.get("min_ms") or r["median_ms"] <= STEADY * r["min_ms"]
            out[(row, "share of dense")] = (r["ratio_to_dense_gemm"], steady)
            if r.get("ratio_to_dense_sustained"):
                out[(row, "share of sustained dense")] = (r["ratio_to_dense_sustained"], steady)
            if r.get("breakdown"):
                out[(row, "GPU busy ms")] = (r["breakdown"]["step_gpu_busy_ms"], True)
        elif _row_kind(r) == "train" and r.get("tokens_per_sec_per_gpu"):
            out[(r["case"], "tokens/s per GPU")] = (r["tokens_per_sec_per_gpu"], True)
            if r.get("peak_memory_gib"):
                out[(r["case"], "peak memory GiB")] = (r["peak_memory_gib"], True)
    return out


def rerun_table(recs: list[dict], tolerance: float = TOLERANCE) -> list[str]:
    """Of one suite's records on one kind of machine (latest first): each step's figures in its
    latest run beside the same figures in the run of that step before (the code before, <step>@base,
    left out), their ratio, whether it lies within `tolerance` of 1, and whether both were steady."""
    out = [
        "| step | row | figure | run before | latest run | before | latest | latest / before | within "
        f"{100 * tolerance:g}% | steady |",
        "|---|---|---|---|---|---:|---:|---:|---|---|",
    ]
    counts = [0, 0, 0, 0]  # figures, within; steady figures, within
    steps = dict.fromkeys(n for rec in recs for n, fig in rec["figures"].items() if fig and not n.endswith("@base"))
    for step in steps:
        runs = [rec for rec in recs if rec["figures"].get(step)]
        if len(runs) < 2:
            continue
        now, then = _figures(runs[0], step), _figures(runs[1], step)
        for key in [k for k in now if k in then]:
            (n, n_steady), (b, b_steady) = now[key], then[key]
            ok, steady = abs(n / b - 1) <= tolerance, n_steady and b_steady
            counts[0] += 1
            counts[1] += ok
            counts[2] += steady
            counts[3] += ok and steady
            out.append(
                f"| {step} | {key[0]} | {key[1]} | {runs[1]['date_utc'][:16]} | {runs[0]['date_utc'][:16]} | "
                f"{_f(b, 3 if b < 10 else 2)} | {_f(n, 3 if n < 10 else 2)} | {_f(n / b, 3)} | {'yes' if ok else 'no'} | {'yes' if steady else 'no'} |"
            )
    if not counts[0]:
        return []
    return out + [
        "",
        f"{counts[1]} of {counts[0]} figures within {100 * tolerance:g}% of the run before; of the "
        f"{counts[2]} steady ones (both medians within {100 * (STEADY - 1):g}% of their fastest repeat), "
        f"{counts[3]}.",
    ]


def _steps(rec: dict, script_rows: str) -> list[tuple[str, dict]]:
    """(step name, figures) of the steps whose figures hold rows of the kind named."""
    out = []
    for name, fig in rec["figures"].items():
        if not fig or "rows" not in fig:
            continue
        rows = fig["rows"]
        if rows and _row_kind(rows[0]) == script_rows:
            out.append((name, fig))
    return out


def _mode(compiled) -> str:
    return compiled if isinstance(compiled, str) else ("compiled" if compiled else "eager")


def _gemm_choice(impl: str) -> str:
    return {"titan_fold": "torch", "titan_fold_quack": "quack", "titan_fold_fp8": "torch, FP8"}.get(impl, impl)


def layer_table(rec: dict) -> list[str]:
    """Each MoE-layer row; where the record holds the dense rate under sustained load too, that
    rate and the row's share of it; where it holds NVML's SM clock, the clock after the dense
    burst, after the sustained rate and after the row's timed loop; where the suite ran the code
    before too (<step>@base), its time and the ratio before / after beside it."""
    steps = [(name, fig) for name, fig in _steps(rec, "layer") if not name.endswith("@base")]
    sustained = any(fig.get("dense_bf16_gemm_tflops_sustained") for _, fig in steps)
    clocked = any(r.get("sm_clock_mhz") for _, fig in steps for r in fig["rows"])
    extra = (" sustained dense TFLOP/s | share of sustained |" if sustained else "") + (
        " SM clock MHz: dense burst, sustained, row |" if clocked else ""
    )
    columns = 6 + 2 * sustained + clocked
    out = [
        "| step | shape | dispatch | moe.grouped_gemm | mode | ms / step | TFLOP/s | dense GEMM TFLOP/s | "
        f"share of dense |{extra} code before: ms | before / after |",
        "|---|---|---|---|---|" + "---:|" * columns,
    ]
    n = 0
    for name, fig in steps:
        base = rec["figures"].get(name + "@base") or {"rows": []}
        before = {
            (r["impl"], r["shape"], r["mode"], r["dispatch"], str(r["compiled"])): r.get("median_ms")
            for r in base["rows"]
        }
        for r in fig["rows"]:
            shape = r["shape"] + ("" if r["mode"] == "dropless" else f" ({r['mode']})")
            lead = f"| {name} | {shape} | {r['dispatch']} | {_gemm_choice(r['impl'])} | {_mode(r['compiled'])} "
            if "error" in r:
                out.append(lead + f"| error: {r['error'][:60]} |" + " |" * (columns - 1))
                continue
            b = before.get((r["impl"], r["shape"], r["mode"], r["dispatch"], str(r["compiled"])))
            rates = f"{_f(fig['dense_bf16_gemm_tflops'])} | {_f(r.get('ratio_to_dense_gemm'), 3)} | "
            if sustained:
                rates += (
                    f"{_f(fig.get('dense_bf16_gemm_tflops_sustained'))} | {_f(r.get('ratio_to_dense_sustained'), 3)} | "
                )
            if clocked:
                dense = fig.get("dense_sm_clock_mhz") or {}
                rates += " / ".join(
                    _f(c, 0) for c in (dense.get("burst"), dense.get("sustained"), r.get("sm_clock_mhz"))
                )
                rates += " | "
            out.append(
                lead + f"| {_f(r['median_ms'], 2)} | {_f(r['tflops'])} | {rates}{_f(b, 2) if b else '-'} | "
                f"{_f(b / r['median_ms'], 3) if b else '-'} |"
            )
            n += 1
    return out if n else []


def layer_breakdown_table(rec: dict) -> list[str]:
    """GPU time of one profiled step (eager, or captured in a CUDA graph) by kernel class, the
    step's time beyond its GPU busy time (eager: the host's gaps; a graph's replay has no host
    work, and there it is what the timed replays take beyond the profiled one's kernels), and the
    time no kernel ran between the step's first kernel and its last (where recorded; in a
    graph's replay, the kernels' boundaries)."""
    classes = ("gemm", "index_scatter_gather", "triton_fused", "add", "mul", "reduce", "elementwise_other", "sort_scan")
    out = [
        "| step | shape | moe.grouped_gemm | mode | step ms | GPU busy ms | step beyond GPU busy, share of step | "
        "GPU idle between kernels ms | kernels | " + " | ".join(classes) + " |",
        "|---|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(classes),
    ]
    n = 0
    for name, fig in _steps(rec, "layer"):
        for r in fig["rows"]:
            b = r.get("breakdown")
            if not b:
                continue
            cls, busy = b["step_gpu_ms_by_kernel_class"], b["step_gpu_busy_ms"]
            gap = max(0.0, r["median_ms"] - busy) / r["median_ms"]
            out.append(
                f"| {name} | {r['shape']} | {_gemm_choice(r['impl'])} | {_mode(r['compiled'])} | "
                f"{_f(r['median_ms'], 2)} | {_f(busy, 2)} | {_f(100 * gap)}% | {_f(b.get('step_gpu_idle_ms'), 3)} | "
                f"{_f(b.get('kernels_per_step'), 0)} | "
                + " | ".join(_f(cls.get(c), 2) if cls.get(c) else "-" for c in classes)
                + " |"
            )
            n += 1
    return out if n else []


def _attention(row: dict) -> str:
    fold = row.get("folding") or {}
    for key, label in (("tp", "tp{} SP"), ("cp", "cp{}"), ("pp", "pp{}")):
        if fold.get(key, 1) > 1:
            return label.format(fold[key])
    return f"dp{row['nproc']} FSDP" if row["nproc"] > 1 else "single"


@functools.cache
def flop_counts(family: str, proxy: str, seq_len: int) -> tuple[int, int]:
    """FLOPs per token of a proxy at seq_len in both counts: titan_fold's (the trainer's MFU,
    TransformerArgs.get_nparams_and_flops: attention causal, over the mean of the q.k and v head
    widths) and torchtitan 0.2.2's (its trainer's MFU, its model args' get_nparams_and_flops for
    the model bench/vs_torchtitan.py builds at the proxy's widths: attention non-causal, over q.k
    plus v). Built on the meta device; the flavors registered for it are taken off again."""
    from bench import vs_torchtitan
    from titan_fold.models import FLAVORS

    flavors = dict(FLAVORS[family])
    try:
        return (
            vs_torchtitan.our_flops_per_token(family, proxy, seq_len),
            vs_torchtitan.torchtitan_flops_per_token(family, proxy, seq_len),
        )
    finally:
        FLAVORS[family].clear()
        FLAVORS[family].update(flavors)


def _proxy(fig: dict) -> tuple[str, str, int] | None:
    """(family, proxy flavor, seq_len) of a trainer or vs-torchtitan step's figures, None where not recorded."""
    proxy = fig.get("titan_fold_proxy") or fig.get("proxy_flavor")
    return (fig["family"], proxy, fig["seq_len"]) if proxy and fig.get("family") and fig.get("seq_len") else None


def _torchtitan_over_ours(fig: dict) -> float | None:
    """torchtitan's FLOP count over titan_fold's for the proxy of a step's figures (None: unknown)."""
    key = _proxy(fig)
    if key is None:
        return None
    ours, theirs = flop_counts(*key)
    return theirs / ours


def _times(x, factor):
    return None if x is None or factor is None else x * factor


def flop_count_table(groups: dict[tuple, list[dict]]) -> list[str]:
    """Each proxy of the trainer and vs-torchtitan records: its FLOPs per token in titan_fold's
    count and in torchtitan's, and how much higher torchtitan's is (its MFU by as much)."""
    proxies = sorted(
        {
            key
            for recs in groups.values()
            for rec in recs
            for fig in rec["figures"].values()
            if isinstance(fig, dict) and "rows" in fig and (key := _proxy(fig))
        }
    )
    out = [
        "| family | proxy | seq_len | titan_fold's count: GFLOP per token | torchtitan's count: GFLOP per token | "
        "torchtitan's over titan_fold's |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for family, proxy, seq_len in proxies:
        ours, theirs = flop_counts(family, proxy, seq_len)
        out.append(
            f"| {family} | {proxy} | {seq_len} | {_f(ours / 1e9, 3)} | {_f(theirs / 1e9, 3)} | "
            f"{100 * (theirs / ours - 1):+.1f}% |"
        )
    return out if proxies else []


# full-depth steps (bench/__main__.py FULL_DEPTH) -> (model, the whole model's flavor, what one GPU runs,
# published runs of that mapping: (who and where, routing, TFLOP/s per GPU in Megatron's count, tokens/s per GPU))
PUBLISHED = {
    "qwen3_30b_a3b_ep8": (
        "Qwen3-30B-A3B",
        "30B-A3B",
        "48 layers, 16 of 128 experts (one EP8 rank)",
        [("NeMo AutoModel, 8 x H100, EP8", "forced balanced", 277, None)],
    ),
    "qwen3_30b_a3b_ep16": (
        "Qwen3-30B-A3B",
        "30B-A3B",
        "48 layers, 8 of 128 experts (one EP16 rank)",
        [("Megatron-Bridge (PR #5123), 16 x H100, EP16, HybridEP, CUDA graphs", "forced balanced", 299, 13000)],
    ),
    "deepseek_v3_16b_ep8": (
        "DeepSeek-V3-16B",
        "16B",
        "27 layers, 8 of 64 experts (one EP8 rank); vocabulary 102,400 (Moonlight's 163,840)",
        [("Moonlight-16B-A3B, 16 x H100, EP8", "natural", 387, None)],
    ),
}
DIFFERS = (
    "one GPU runs one EP rank's work: no all-to-all, no gradient reduction over data-parallel ranks, no "
    "pipeline; the H200 has the H100 SXM's 989 TFLOP/s bf16 peak with 1.4x its memory bandwidth and 141 GB; "
    "bf16 weights and optimizer states (the published runs keep fp32 main weights, sharded). TFLOP/s count "
    "the whole model's FLOPs per token (bench/flops.py) at the tokens/s measured"
)


def published_table(groups: dict[tuple, list[dict]]) -> list[str]:
    """The full-depth suite's latest row of each step and case on each GPU, then the published runs of
    the same model and EP degree: tokens/s per GPU and TFLOP/s per GPU in Megatron's FLOP count (the
    published figures'), titan_fold's and torchtitan's (bench/flops.py), of the whole model per token."""
    from bench import flops

    rows = {}
    for (suite, device, count), recs in groups.items():
        if suite != "full-depth" or count != 1:
            continue
        for rec in reversed(recs):  # oldest first: a later record's row replaces an earlier one's
            for step, fig in rec["figures"].items():
                for row in (fig or {}).get("rows", []):
                    if row.get("tokens_per_sec_per_gpu"):
                        name, routing = step.rsplit("_", 1)
                        rows.setdefault(name, {})[(device, routing, row["case"])] = (fig, row, rec)
    out = [
        "| model | one GPU runs | routing | run | micro-batch x micro-batches | tokens/s per GPU | "
        "TFLOP/s per GPU: Megatron's count | titan_fold's count | torchtitan's count | record |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    counted = {}  # (family, flavor, seq_len) -> its three counts, each built once
    for name, (model, flavor, runs, theirs) in PUBLISHED.items():
        for (device, routing, case), (fig, row, rec) in sorted(rows.get(name, {}).items()):
            key = (fig["family"], flavor, fig["seq_len"])
            if key not in counted:
                counted[key] = flops.counts(*key)
            counts = counted[key]
            tps = row["tokens_per_sec_per_gpu"]
            batch = case.rsplit("_b", 1)[1].replace("_ga", " x ")
            tflops = " | ".join(_f(tps * counts[k] / 1e12, 0) for k in ("megatron", "titan_fold", "torchtitan"))
            out.append(
                f"| {model} | {runs} | {routing} | titan_fold, 1 x {device} | {batch} | {_f(tps, 0)} | {tflops} | "
                f"`{rec['_file']}` |"
            )
        if name in rows:
            for who, routing, tflops_published, tps in theirs:
                out.append(
                    f"| {model} | {runs} | {routing} | published: {who} | | {_f(tps, 0)} | {tflops_published} | | | |"
                )
    return out if rows else []


def expert_path(row: dict) -> str:
    """The kernels a trainer row's routed experts ran (bench/train_step.py's counters): each path
    counted, by eager calls and by graphs compiled; "unknown" where none was counted (a record
    from before the counters, or counters that missed the path), never zeros."""
    calls, compiled = row.get("expert_path_calls") or {}, row.get("expert_path_compiled") or {}
    parts = [f"{path} {n}" for path, n in calls.items() if n] + [
        f"{path} {n} graph{'s' if n > 1 else ''}" for path, n in compiled.items() if n
    ]
    return ", ".join(parts) or "unknown"


def train_table(rec: dict) -> list[str]:
    out = [
        "| step | case | GPUs | attention | experts (ep, etp, edp) | expert path: calls, graphs compiled | "
        "tokens/s per GPU | TFLOP/s per GPU | MFU %, titan_fold's count | MFU %, torchtitan's count | "
        "peak memory GiB | step s | loss first -> last |",
        "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    n = 0
    for name, fig in _steps(rec, "train"):
        if "titan_fold_proxy" in fig:
            continue  # torchtitan's rows (bench/vs_torchtitan.py): vs_table
        theirs = _torchtitan_over_ours(fig)
        for r in fig["rows"]:
            if "tokens_per_sec_per_gpu" not in r:
                continue
            fold = r.get("folding")
            experts = f"{fold['ep']}, {fold['etp']}, {fold['edp']}" if fold else "-"
            status = "" if r["returncode"] == 0 else f" (rc {r['returncode']})"
            out.append(
                f"| {name} | {r['case']}{status} | {r['nproc']} | {_attention(r)} | {experts} | "
                f"{expert_path(r)} | {_f(r['tokens_per_sec_per_gpu'], 0)} | {_f(r['tflops_per_gpu'])} | "
                f"{_f(r['mfu_pct'])} | {_f(_times(r['mfu_pct'], theirs))} | "
                f"{_f(r['peak_memory_gib'])} | {_f(r['step_time_s'], 3)} | "
                f"{_f(r['loss_first'], 2)} -> {_f(r['loss_last'], 2)} |"
            )
            n += 1
    return out if n else []


def train_breakdown_table(rec: dict) -> list[str]:
    """Profiled trainer steps (case modifier `profile`): the time some kernel runs (GPU busy), the
    step's wall time without the profiler (the same case without `profile`, in the same run: the
    profiler's own host work slows the traced step), the rest of that step (host gaps) as a share
    of it, the step before's kernels that ran inside the trace (counted in nothing else), the GPU's
    idle time between the step's first kernel and its last (waits of 20 us or more, and their
    count), and GPU time by kernel class."""
    rows = [(name, fig, r) for name, fig in _steps(rec, "train") for r in fig["rows"] if r.get("trace_summary")]
    if not rows:
        return []
    classes = sorted(
        {c for *_, r in rows for c in r["trace_summary"]["kernel_ms_by_class"]},
        key=lambda c: -max(r["trace_summary"]["kernel_ms_by_class"].get(c, 0.0) for *_, r in rows),
    )
    # the column only where some summary tells the step before's kernels apart (earlier_step_ms)
    earlier = any("earlier_step_ms" in r["trace_summary"] for *_, r in rows)
    idle = any("idle" in r["trace_summary"] for *_, r in rows)  # likewise the GPU's idle intervals
    out = [
        "| step | case | traced step ms | step ms without profiler | GPU busy ms | host gaps, share of step | "
        + ("step before's kernels ms | " if earlier else "")
        + ("GPU idle ms (waits) | " if idle else "")
        + " | ".join(classes)
        + " |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * (len(classes) + earlier + idle),
    ]
    for name, fig, r in rows:
        t = r["trace_summary"]
        busy = t["gpu_busy_ms"]
        plain = next(
            (
                1e3 * q["step_time_s"]
                for q in fig["rows"]
                if q["case"] == r["case"].replace("_profile", "") and q.get("step_time_s")
            ),
            None,
        )
        gaps = f"{100 * (plain - busy) / plain:.1f}%" if plain else "n/a"
        out.append(
            f"| {name} | {r['case']} | {_f(t['step_wall_ms'])} | {_f(plain)} | {_f(busy)} | {gaps} | "
            + (f"{_f(t.get('earlier_step_ms'), 1)} | " if earlier else "")
            + (
                (f"{_f(t['idle']['idle_ms'], 2)} ({t['idle']['waits']}) | " if "idle" in t else "n/a | ")
                if idle
                else ""
            )
            + " | ".join(_f(t["kernel_ms_by_class"].get(c), 1) for c in classes)
            + " |"
        )
    return out


def train_phases_table(rec: dict) -> list[str]:
    """Trainer cases with the modifier `phases` (metrics.step_phases): each phase's median host and
    GPU milliseconds per step; a phase whose GPU time is about its host time was paced by the host."""
    rows = [(name, r) for name, fig in _steps(rec, "train") for r in fig["rows"] if r.get("phases")]
    if not rows:
        return []
    phases = list(dict.fromkeys(p for _, r in rows for p in r["phases"]))
    out = [
        "| step | case | " + " | ".join(f"{p} host / GPU ms" for p in phases) + " |",
        "|---|---|" + "---:|" * len(phases),
    ]
    for name, r in rows:
        cells = []
        for p in phases:
            t = r["phases"].get(p)
            cells.append("-" if t is None else f"{_f(t['host_ms'])} / {_f(t['gpu_ms'])}")
        out.append(f"| {name} | {r['case']} | " + " | ".join(cells) + " |")
    return out


def vs_table(rec: dict) -> list[str]:
    """torchtitan's rows beside titan_fold's, each trainer's MFU in both counts (flop_counts): the
    one it logged, and the other's from it (the same tokens/s and peak, the count's ratio)."""
    out = [
        "| step | case | torchtitan tokens/s | titan_fold tokens/s | titan_fold / torchtitan | torchtitan MFU %, "
        "torchtitan's count | torchtitan MFU %, titan_fold's count | titan_fold MFU %, titan_fold's count | "
        "titan_fold MFU %, torchtitan's count |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    n = 0
    for name, fig in _steps(rec, "train"):
        if "titan_fold_proxy" not in fig:
            continue
        theirs = _torchtitan_over_ours(fig)
        for r in fig["rows"]:  # titan_fold's figures n/a where its step left none
            ours_mfu = r.get("titan_fold_mfu_pct")
            out.append(
                f"| {name} | {r['case']} | {_f(r['tokens_per_sec_per_gpu'], 0)} | "
                f"{_f(r.get('titan_fold_tokens_per_sec'), 0)} | {_f(r.get('ratio_titan_fold_over_torchtitan'), 3)} | "
                f"{_f(r['mfu_pct'])} | {_f(_times(r['mfu_pct'], theirs and 1 / theirs))} | "
                f"{_f(ours_mfu)} | {_f(_times(ours_mfu, theirs))} |"
            )
            n += 1
    return out if n else []


CURVE_WINDOW = 20  # steps per window of the curve's means; the first window, the loss's fall, is left out


def _curve_differences(losses: list[float], ref: list[float]) -> tuple[float | None, float | None]:
    """Relative differences of a curve to a reference curve after its first CURVE_WINDOW steps: the
    largest over the means of successive CURVE_WINDOW-step windows, and that of the mean of all
    those steps (the curve's level, signed)."""
    n = min(len(losses), len(ref))
    windows = [
        abs(sum(losses[i : i + CURVE_WINDOW]) / sum(ref[i : i + CURVE_WINDOW]) - 1)
        for i in range(CURVE_WINDOW, n - CURVE_WINDOW + 1, CURVE_WINDOW)
    ]
    level = sum(losses[CURVE_WINDOW:n]) / sum(ref[CURVE_WINDOW:n]) - 1 if n > CURVE_WINDOW else None
    return max(windows, default=None), level


def _pct(x: float | None, signed: bool = False) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f}%" if signed else f"{100 * x:.2f}%"


def _runs(n: int) -> str:
    return f"{n} run" + "s" * (n != 1)


def _path(case: str) -> str:
    """The run's code path: its case without the naming modifier rerun."""
    return case.removesuffix("_rerun")


def loss_curve_table(rec: dict) -> list[str]:
    """Runs of one step compared to its first case: the largest relative difference of the loss
    step by step (one step's noise) and, after the first 20 steps, of the means of successive
    20-step windows (the curve) and of the mean of all those steps (the curve's level); where a path
    ran twice, the differences between runs of one path beside those between runs of two paths, and
    between the paths' mean curves."""
    out = [
        "| step | case | steps | loss first -> last | mean of last 20 | relative difference to the first case: "
        "max per step | max of 20-step means after step 20 | mean after step 20 |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    pairs = [
        "| step | runs compared | pairs | max difference of 20-step means after step 20 | "
        "difference of the means after step 20 |",
        "|---|---|---:|---:|---|",
    ]
    for name, fig in _steps(rec, "train"):
        rows = [r for r in fig["rows"] if r.get("losses")]
        if len(rows) < 2:
            continue
        ref = rows[0]["losses"]
        for r in rows:
            step = max((abs(a - b) / abs(b) for a, b in zip(r["losses"], ref, strict=True)), default=None)
            curve, level = _curve_differences(r["losses"], ref)
            out.append(
                f"| {name} | {r['case']} | {len(r['losses'])} | {_f(r['loss_first'], 3)} -> {_f(r['loss_last'], 3)} | "
                f"{_f(r['loss_mean_last20'], 4)} | {_pct(step)} | {_pct(curve)} | {_pct(level, True)} |"
            )
        pairs += _path_pairs(name, rows)
    if len(out) == 2:
        return []
    return out + (
        ["", "Runs of one path against runs of two paths (the run-to-run spread beside the paths' difference):", ""]
        + pairs
        if len(pairs) > 2
        else []
    )


def _path_pairs(name: str, rows: list[dict]) -> list[str]:
    """Rows of the pairs table for one step whose paths ran more than once (none otherwise)."""
    paths = {}
    for r in rows:
        paths.setdefault(_path(r["case"]), []).append(r["losses"])
    if len(paths) < 2 or all(len(runs) < 2 for runs in paths.values()):
        return []
    names = list(paths)
    # each pair as (later run, earlier run): a later run of one path against its earlier, the second
    # path's runs against the first's
    groups = [(f"within {p}", [(b, a) for i, a in enumerate(paths[p]) for b in paths[p][i + 1 :]]) for p in names]
    groups.append(
        (
            f"across paths ({', '.join(names[1:])} against {names[0]})",
            [(b, a) for i, p in enumerate(names) for q in names[i + 1 :] for a in paths[p] for b in paths[q]],
        )
    )
    out = []
    for label, group in groups:
        if not group:
            continue
        diffs = [_curve_differences(a, b) for a, b in group]
        curve = max((c for c, _ in diffs if c is not None), default=None)
        levels = sorted({lv for _, lv in diffs if lv is not None})
        level = (
            "n/a"
            if not levels
            else _pct(levels[0], True)
            if len(levels) == 1
            else f"{_pct(levels[0], True)} to {_pct(levels[-1], True)}"
        )
        out.append(f"| {name} | {label} | {len(group)} | {_pct(curve)} | {level} |")
    means = {p: _mean_curve(runs) for p, runs in paths.items()}
    for p in names[1:]:
        curve, level = _curve_differences(means[p], means[names[0]])
        out.append(
            f"| {name} | mean curve of {p} ({_runs(len(paths[p]))}) against {names[0]} "
            f"({_runs(len(paths[names[0]]))}) | 1 | {_pct(curve)} | {_pct(level, True)} |"
        )
    return out


def _mean_curve(runs: list[list[float]]) -> list[float]:
    return [sum(step) / len(runs) for step in zip(*runs, strict=True)]


def _mean_sd(xs: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None


def pooled_loss_curves(recs: list[dict]) -> list[str]:
    """Every recorded run of each loss-curve step (a step's name fixes its training arguments),
    over all records and machines, by path: the runs' levels after step 20 (mean and standard
    deviation over runs), and each path's mean curve against the first path's, with the standard
    error of the levels' difference. One path's runs part after a few steps (the GPU step is not
    deterministic from run to run, and training amplifies the difference), so two paths are
    compared by their means over many runs."""
    steps = {}
    for rec in sorted(recs, key=lambda r: r["date_utc"]):
        for name, fig in _steps(rec, "train"):
            for r in fig["rows"]:
                if r.get("losses"):
                    runs = steps.setdefault(name, {}).setdefault(_path(r["case"]), [])
                    runs.append((r["losses"], rec["env"]["device"]))
    out = [
        "| step | path | runs | machines | mean after step 20, over runs | standard deviation over runs | "
        "mean curve against the first path: max difference of 20-step means after step 20 | "
        "difference of the means after step 20 | its standard error |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, paths in steps.items():
        if len(paths) < 2:
            continue
        stats = {
            p: _mean_sd([sum(c[CURVE_WINDOW:]) / len(c[CURVE_WINDOW:]) for c, _ in runs]) for p, runs in paths.items()
        }
        ref = next(iter(paths))
        ref_curve = _mean_curve([c for c, _ in paths[ref]])
        (ref_mean, ref_sd), n_ref = stats[ref], len(paths[ref])
        for p, runs in paths.items():
            mean, sd = stats[p]
            compared = "(the reference) | | |"
            if p != ref:
                curve, level = _curve_differences(_mean_curve([c for c, _ in runs]), ref_curve)
                err = (
                    None if sd is None or ref_sd is None else (sd**2 / len(runs) + ref_sd**2 / n_ref) ** 0.5 / ref_mean
                )
                compared = f"{_pct(curve)} | {_pct(level, True)} | {_pct(err)} |"
            machines = ", ".join(sorted({d for _, d in runs}))
            out.append(f"| {name} | {p} | {len(runs)} | {machines} | {_f(mean, 4)} | {_f(sd, 4)} | {compared}")
    return out if len(out) > 2 else []


def grouped_gemm_table(rec: dict) -> list[str]:
    """bench/grouped_gemm.py: each routed grouped GEMM's TFLOP/s alone and the share of the dense
    rate the routed GEMMs allow, per rows per expert (drawn, equal) and GEMM path; where recorded,
    the share of their roofline they reach, and the times of QuACK's path with the configs QuACK's
    frontends tune over its times with moe/quack.py's: the gathered up projection's, and the four
    varlen-M GEMMs' summed (records before that sum timed the up projection's alone); "stacked w13 /
    ours" is from records of the experts that held w1 and w3 apart (a stacked w13 timed beside
    them), n/a since the experts hold w13."""
    fig = rec["figures"].get("grouped_gemm")
    if not fig:
        return []
    gemms = ("up_fwd", "up_dgrad", "up_wgrad", "down_fwd", "down_dgrad", "down_wgrad")
    out = [
        "| shape | rows per expert | moe.grouped_gemm | dense GEMM TFLOP/s | "
        + " | ".join(g.replace("_", " ") for g in gemms)
        + " | routed GEMMs TFLOP/s | gemm_bound_share | with shared | share of roofline | up fwd, QuACK's tuning "
        "/ ours | varlen-M GEMMs, QuACK's tuning / ours | stacked w13 / ours |",
        "|---|---|---|---:|" + "---:|" * (len(gemms) + 7),
    ]
    for r in fig["rows"]:
        case = "| " + " | ".join(_gemm_case(r)) + " |"
        if "error" in r:
            out.append(f"{case} error: {r['error'][:60]} |" + " |" * (len(gemms) + 7))
            continue
        tuned = r.get("tunings", {})
        up_tuned = tuned.get("up_fwd", r.get("up_fwd_tunings", {}))
        out.append(
            f"{case} {_f(fig['dense_bf16_gemm_tflops'])} | "
            + " | ".join(_f(r["gemms"][g]["tflops"]) for g in gemms)
            + f" | {_f(r['routed_gemms_tflops'])} | {_f(r['gemm_bound_share'], 3)} | "
            f"{_f(r['gemm_bound_share_with_shared'], 3)} | {_f(r.get('share_of_roofline'), 3)} | "
            f"{_f(up_tuned.get('quack_over_titan_fold'), 3)} | "
            f"{_f(tuned.get('varlen_m', {}).get('quack_over_titan_fold'), 3)} | "
            f"{_f(r.get('experts_fwd_bwd', {}).get('stacked_over_separate'), 3)} |"
        )
    return out


def row_movement_table(rec: dict) -> list[str]:
    fig = rec["figures"].get("row_movement")
    if not fig:
        return []
    out = [
        "| shape | rows MiB | indexing ms | embedding_bag ms | gather_sum ms | dispatcher ms | dispatcher speedup |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in fig["rows"]:
        out.append(
            f"| {r['shape']} | {_f(r['row_bytes_mib'], 0)} | {_f(r['indexing_ms'], 2)} | "
            f"{_f(r['embedding_bag_ms'], 2)} | {_f(r['gather_sum_ms'], 2)} | {_f(r['dispatcher_ms'], 2)} | "
            f"{_f(r['dispatcher_speedup'], 2)} |"
        )
    return out


def routing_table(rec: dict) -> list[str]:
    """bench/routing.py: the router's choice of k (aten's topk, a sort's head, k argmax passes; where
    the shape's model limits the choice to groups, that choice with topk and with argmax passes),
    the grouping's sort per key width (us); then the router's whole per-token work compiled and as
    Triton kernels: the kernels of its forward and of its backward, and a forward + backward's us."""
    fig = rec["figures"].get("routing")
    if not fig:
        return []
    widths = ("int64", "int32", "int16", "uint8")
    keys = [
        "choice_topk_us",
        "choice_sort_head_us",
        "choice_argmax_us",
        "grouped_choice_topk_us",
        "grouped_choice_argmax_us",
        *(f"grouping_sort_{w}_us" for w in widths),
        "group_by_us",
    ]
    out = [
        "| shape | experts | mode | topk | sort's head | k argmax passes | group-limited, topk | "
        "group-limited, argmax passes | " + " | ".join(f"sort of {w} keys" for w in widths) + " | group_by |",
        "|---|---:|---|" + "---:|" * len(keys),
    ]
    for r in fig["rows"]:
        cells = " | ".join(_f(r[key]) if key in r else "-" for key in keys)
        out.append(f"| {r['shape']} | {r['experts']} | {_mode(r['compiled'])} | {cells} |")
    if fig.get("routes"):
        ways = ("compiled", "triton")
        out += [
            "",
            "| shape | route's settings | "
            + " | ".join(
                f"{way}: forward kernels | {way}: backward kernels | {way}: forward + backward us" for way in ways
            )
            + " |",
            "|---|---|" + "---:|" * 3 * len(ways),
        ]
        for r in fig["routes"]:
            settings = ", ".join(f"{k} {v}" for k, v in r["route"].items()) or "softmax"
            cells = []
            for way in ways:
                kernels = [_route_figure(r, way, f"{d}_kernels") for d in ("forward", "backward")]
                cells += ["-" if k is None else str(len(k)) for k in kernels] + [_f(_route_figure(r, way, "us"))]
            out.append(f"| {r['shape']} | {settings} | " + " | ".join(cells) + " |")
    return out


def _route_figure(row: dict, way: str, figure: str):
    # records before the Triton way named the compiled way's figures route_<figure>
    return row.get(f"route_{way}_{figure}", row.get(f"route_{figure}") if way == "compiled" else None)


def streams_table(rec: dict) -> list[str]:
    """bench/grad_norm.py and bench/master_step.py: ms, TB/s and, for the norm, the host's ms to queue
    one call; the code before's rows (<step>@base) first where the suite ran it."""
    out = ["| step | way | ms | TB/s | host ms |", "|---|---|---:|---:|---:|"]
    n = 0
    for name in ("grad_norm@base", "grad_norm", "master_step@base", "master_step"):
        for r in (rec["figures"].get(name) or {}).get("rows", []):
            out.append(
                f"| {name} | {r.get('way') or r.get('kernel')} | {_f(r.get('ms'), 3)} | {_f(r.get('tb_per_s'), 2)} | {_f(r.get('host_ms'), 3)} |"
            )
            n += 1
    return out if n else []


def attention_table(rec: dict) -> list[str]:
    """bench/attention.py: each proxy's attention per SDPA backend and as the models call it."""
    fig = rec["figures"].get("attention")
    if not fig:
        return []
    out = [
        "| proxy | heads (kv) | head_dim q.k / v | way | ms | TFLOP/s | max rel err vs fp32 math |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in fig["rows"]:
        head = f"| {r['family']} {r['proxy']} | {r['heads']} ({r['kv_heads']}) | {r['qk_dim']} / {r['v_dim']} | {r['way']} |"
        if "error" in r:
            out.append(f"{head} not taken | | |")
        else:
            out.append(f"{head} {_f(r['ms'], 3)} | {_f(r['tflops'])} | {r['max_rel_err_vs_fp32_math']:.1e} |")
    return out


def launch_table(rec: dict) -> list[str]:
    """bench/launch.py: host microseconds per call; beside the code before's (launch@base) where the suite ran it."""
    now, before = rec["figures"].get("launch"), rec["figures"].get("launch@base")
    if not now:
        return []
    base = {r["call"]: r["host_us"] for r in (before or {}).get("rows", [])}
    out = ["| call | host us | code before: host us | before / after |", "|---|---:|---:|---:|"]
    for r in now["rows"]:
        b = base.get(r["call"])
        out.append(
            f"| {r['call']} | {_f(r['host_us'])} | {_f(b) if b else '-'} | {_f(b / r['host_us'], 2) if b else '-'} |"
        )
    return out


def dry_run_table(rec: dict) -> list[str]:
    """bench/dry_run.py: the CPU seconds of `--comm.mode fake_backend` as README shows it."""
    fig = rec["figures"].get("dry_run")
    if not fig:
        return []
    out = [
        "| config | ranks | collective check | dry run's CPU s | process CPU s (with imports) | wall s |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in fig["rows"]:
        out.append(
            f"| {r['config']} | {r['ranks']} | {'yes' if r['collectives'] else 'no'} | {_f(r['dry_run_cpu_s'])} "
            f"| {_f(r['process_cpu_s'])} | {_f(r['wall_s'])} |"
        )
    return out


def collectives_table(rec: dict) -> list[str]:
    fig = rec["figures"].get("collectives")
    if not fig:
        return []
    cases = (
        "raw_all_to_all",
        "dispatcher_a2a_even",
        "dispatcher_a2a_uneven",
        "raw_all_gather",
        "dispatcher_all_gather_v",
    )
    out = [
        "| payload | buffer MiB | " + " | ".join(f"{c} GB/s (ms)" for c in cases) + " |",
        "|---|---:|" + "---:|" * len(cases),
    ]
    for r in fig["rows"]:
        out.append(
            f"| {r['payload']} | {_f(r['buffer_mib'])} | "
            + " | ".join(f"{_f(r[c]['out_GBps'])} ({_f(r[c]['median_ms'], 3)})" for c in cases)
            + " |"
        )
    return out


def _proxy_mfu(case: str):
    """The Qwen3-30B-A3B proxy's MFU % in case, from a trainer or vs-torchtitan record."""

    def value(rec):
        fig = rec["figures"].get("qwen3_30b_a3b_l12") or {}
        return next((r["mfu_pct"] for r in fig.get("rows", []) if r.get("case") == case and r.get("mfu_pct")), None)

    return value


def _over_torchtitan(case: str):
    """titan_fold's tokens/s over torchtitan 0.2.2's on the Qwen3-30B-A3B proxy in case, one record."""

    def value(rec):
        fig = rec["figures"].get("torchtitan_qwen3_30b_a3b_l12") or {}
        return next(
            (
                r["ratio_titan_fold_over_torchtitan"]
                for r in fig.get("rows", [])
                if r.get("case") == case and r.get("ratio_titan_fold_over_torchtitan")
            ),
            None,
        )

    return value


def _layer_rows(rec: dict, shape: str) -> list[dict]:
    # one GPU's dropless layer rows at shape, the code before's (<step>@base) left out
    return [
        r
        for name, fig in _steps(rec, "layer")
        if not name.endswith("@base")
        for r in fig["rows"]
        if r["shape"] == shape and r["mode"] == "dropless" and r["dispatch"] == "none" and "median_ms" in r
    ]


def _layer_share(shape: str):
    """The MoE layer's best share of the dense GEMM burst at shape with QuACK's GEMMs, over the
    modes (eager, compiled, captured) of one record."""

    def value(rec):
        return max(
            (
                r["ratio_to_dense_gemm"]
                for r in _layer_rows(rec, shape)
                if r["impl"] == "titan_fold_quack" and r.get("ratio_to_dense_gemm")
            ),
            default=None,
        )

    return value


def _quack_not_slower(shape: str):
    """The layer's time with torch's grouped GEMMs over its time with QuACK's at shape, the least
    over the modes of one record both ran in (the same step)."""

    def value(rec):
        times = {(r["impl"], str(r["compiled"])): r["median_ms"] for r in _layer_rows(rec, shape)}
        return min(
            (
                times[("titan_fold", mode)] / ms
                for (impl, mode), ms in times.items()
                if impl == "titan_fold_quack" and ("titan_fold", mode) in times
            ),
            default=None,
        )

    return value


# What the fine-grained MoE work aims for on one H100 and one H200: (goal, suites whose records
# hold its figure, the figure of a record or None, the least value that meets it)
PROXY_CASES = (("eager", "1gpu_bf16params_auxfree", 30), ("compiled", "1gpu_bf16params_auxfree_compiled", 35))
GOALS = (
    *(
        (
            f"Qwen3-30B-A3B proxy, {mode}: MFU % (titan_fold's count)",
            ("trainer", "vs-torchtitan"),
            _proxy_mfu(case),
            least,
        )
        for mode, case, least in PROXY_CASES
    ),
    *(
        (
            f"Qwen3-30B-A3B proxy, {mode}: tokens/s over torchtitan 0.2.2's",
            ("vs-torchtitan",),
            _over_torchtitan(case),
            1.6,
        )
        for mode, case, _ in PROXY_CASES
    ),
    *(
        (
            f"MoE layer at {name} shapes, QuACK's GEMMs, best mode: share of dense",
            ("layer",),
            _layer_share(shape),
            least,
        )
        for name, shape, least in (("Qwen3-30B-A3B", "qwen3_30b_a3b", 0.60), ("G8T8", "mixtral_8x22b_g8t8", 0.75))
    ),
    *(
        (
            f"MoE layer at {name} shapes: time with torch's GEMMs over QuACK's",
            ("layer",),
            _quack_not_slower(shape),
            0.99,
        )
        for name, shape in (("Qwen2-57B-A14B", "qwen2_57b_a14b"), ("Mixtral-8x22B", "mixtral_8x22b"))
    ),
)


def goals_table(groups: dict[tuple, list[dict]]) -> list[str]:
    """Each goal on each kind of one-GPU machine: its figure in the latest record holding it and
    the best recorded (either may come from older code: the record's date says which run), and
    whether each meets the goal."""
    out = [
        "| goal | at least | GPU | latest | run | met | best | run | met |",
        "|---|---:|---|---:|---|---|---:|---|---|",
    ]
    for goal, suites, value, least in GOALS:
        found = {}  # device -> (date, figure) of each record holding the goal's figure
        for (suite, device, count), recs in groups.items():
            if suite in suites and count == 1:
                found.setdefault(device, []).extend(
                    (rec["date_utc"], v) for rec in recs if (v := value(rec)) is not None
                )
        for device, runs in sorted((d, runs) for d, runs in found.items() if runs):
            (latest_at, latest), (best_at, best) = max(runs), max(runs, key=lambda run: run[1])
            digits = 1 if least >= 10 else 3
            out.append(
                f"| {goal} | {_f(least, digits)} | {device} | {_f(latest, digits)} | {latest_at[:16]} | "
                f"{'yes' if latest >= least else 'no'} | {_f(best, digits)} | {best_at[:16]} | "
                f"{'yes' if best >= least else 'no'} |"
            )
    return out if len(out) > 2 else []


def replay_table(rec: dict) -> list[str]:
    """bench/replay_mismatch.py (suite rl): the engine's routing and log-probs against titan_fold's,
    without and with moe.routing_replay = "rollout"."""
    fig = rec["figures"].get("replay_mismatch")
    if not fig:
        return []
    off, on = fig["off"], fig["rollout"]
    rows = [
        "| | off | rollout (R3) |",
        "|---|---|---|",
        f"| (token, MoE layer) routings that differ from the engine's | {_pct(fig['routings_differing'])} | 0 |",
        f"| mean abs log-prob gap, response tokens | {off['logprob_gap']:.4f} | {on['logprob_gap']:.4f} |",
        f"| k3 KL(engine, trainer), response tokens | {off['kl_k3']:.2e} | {on['kl_k3']:.2e} |",
        f"| policy step (ms, median) | {off['step_ms']:.1f} | {on['step_ms']:.1f} |",
    ]
    same = "yes" if fig["off_same_weights"] and fig["rollout_same_weights"] else "NO"
    return rows + [
        "",
        f"{fig['family']} {fig['proxy']}, {fig['rollouts']} rollouts of {fig['prompt']} + {fig['response']} tokens; "
        f"replay / off step time {fig['replay_over_off_step_ms']:.3f}; both trainers on the sampled weights: {same}.",
    ]


def gdn_table(rec: dict) -> list[str]:
    """bench/gdn.py (suite gdn): Qwen3.5's Gated DeltaNet layer beside its full-attention layer."""
    fig = next((f for name, f in rec["figures"].items() if name.startswith("gdn") and f), None)
    if not fig:
        return []
    rows = [
        "| batch x seq | full attention (ms) | Gated DeltaNet (ms) | per token, GDN / full | GDN rule | compiled |",
        "|---|---|---|---|---|---|",
    ]
    for r in fig["rows"]:
        rows.append(
            f"| {r['batch']} x {r['seq_len']} | {r['full_ms']:.2f} | {r['linear_ms']:.2f} | "
            f"{r['linear_over_full']:.2f} | {r['rule']} | {'yes' if r['compiled'] else 'no'} |"
        )
    return rows


def rl_report(results: str = RESULTS) -> str:
    """docs/rl.md's measured table: the latest `rl` record."""
    recs = [rec for (suite, _, _), group in records(results).items() if suite == "rl" for rec in group]
    if not recs:
        return ""
    rec = max(recs, key=lambda r: r["date_utc"])
    env = rec["env"]
    head = f"One {env['device']}, torch {env['torch']}, {rec['date_utc'][:10]} (`{rec['_file']}`):"
    return "\n".join([head, "", *replay_table(rec)])


TABLES = (
    ("MoE layer, forward + backward", layer_table),
    ("MoE layer, GPU time by kernel class (ms)", layer_breakdown_table),
    ("Trainer", train_table),
    ("Trainer, one profiled step: GPU time by kernel class (ms)", train_breakdown_table),
    ("Trainer step phases, medians per step (metrics.step_phases)", train_phases_table),
    ("Beside torchtitan 0.2.2", vs_table),
    ("Loss curves", loss_curve_table),
    ("Routed grouped GEMMs alone", grouped_gemm_table),
    ("Row movement (dispatch + combine, fwd + bwd)", row_movement_table),
    ("Routing: the router's choice of k and the grouping's sort (us)", routing_table),
    ("Gradient norm and the optimizer step", streams_table),
    ("Attention forward + backward per SDPA backend", attention_table),
    ("Host time per call of the eager path's generated kernels", launch_table),
    ("Collectives", collectives_table),
    ("The dry run's CPU time", dry_run_table),
    ("Routing replay against the engine's mismatch", replay_table),
    ("Qwen3.5's token mixers, forward + backward", gdn_table),
)


def summary(results: str = RESULTS) -> str:
    """docs/benchmarks.md's tables: the goals, the MFU counts and the latest record of each suite
    on each machine (report() holds every record's tables)."""
    groups = records(results)
    text = _headline(groups)
    rows = ["| suite | machine | latest run | record |", "|---|---|---|---|"]
    for (suite, device, count), recs in groups.items():
        machine = f"{count} x {device}" if count else device
        rows.append(f"| `{suite}` | {machine} | {recs[0]['date_utc'][:16]} | `{recs[0]['_file']}` |")
    text += ["### The latest record of each suite on each machine", ""] + rows + [""]
    return "\n".join(text)


def _headline(groups: dict) -> list[str]:
    text = []
    goals = goals_table(groups)
    if goals:
        text += ["### Fine-grained MoE goals: the latest and the best recorded figure on each GPU", ""] + goals + [""]
    comparable = published_table(groups)
    if comparable:
        text += ["### Comparable with published runs", "", f"What differs: {DIFFERS}.", ""] + comparable + [""]
    counts = flop_count_table(groups)
    if counts:
        text += ["### MFU: titan_fold's FLOP count and torchtitan 0.2.2's, per proxy", ""] + counts + [""]
    return text


def report(results: str = RESULTS) -> str:
    groups = records(results)
    text = _headline(groups)
    loss_curves = [key for key in groups if key[0] == "loss-curve"]
    for key, recs in groups.items():
        for rec in _shown(recs):
            text += _record_text(rec)
        lines = rerun_table(recs)  # each step's latest run beside its run before: does it reproduce?
        if lines:
            text += ["Each step's latest run beside its run before on this kind of machine:", ""] + lines + [""]
        if loss_curves and key == loss_curves[-1]:  # after the suite's last machine: its runs on every machine together
            pooled = pooled_loss_curves([rec for k in loss_curves for rec in groups[k]])
            if pooled:
                text += (
                    ["### Suite `loss-curve`: every recorded run, pooled over records and machines", ""] + pooled + [""]
                )
    return "\n".join(text)


def _measured(rec: dict) -> set[tuple[str, str | None]]:
    """(step, row label or None) of each figure set a record holds, the code before's left out."""
    return {
        (name, _row_label(row) if isinstance(row, dict) else None)
        for name, fig in rec["figures"].items()
        if fig and not name.endswith("@base")
        for row in (fig.get("rows") or [None])
    }


def _shown(recs: list[dict]) -> list[dict]:
    """Of one suite's records on one kind of machine (latest first), those holding the latest
    figures of some row of some step (a layer shape and mode, a trainer case): a run of part of a
    suite (--steps, --cases, fewer shapes) leaves the records of the rest shown."""
    shown, covered = [], set()
    for rec in recs:
        measured = _measured(rec)
        if measured - covered:
            shown.append(rec)
            covered |= measured
    return shown


def _record_text(rec: dict) -> list[str]:
    env = rec["env"]
    gpus = f"{env['device_count']} x {env['device']}" if env["device_count"] else env["device"]
    cpu = f", host CPU {env['cpu']}" if env.get("cpu") else ""
    text = [
        f"### Suite `{rec['suite']}`: {gpus}, torch {env['torch']}, {rec['date_utc'][:10]}{cpu}",
        "",
        f"Command: `{rec['command']}`"
        if rec.get("command")
        else "Assembled from the per-script results of that date; each step's command is in the file.",
        "",
    ]
    if rec.get("note"):  # how a record came to be, where its command alone does not say
        text += [f"Note: {rec['note']}", ""]
    for title, fn in TABLES:
        lines = fn(rec)
        if lines:
            text += [f"{title}:", ""] + lines + [""]
    return text


def _replace_block(doc: str, tables: str) -> None:
    with open(doc) as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(doc, "w") as f:
        f.write(head + BEGIN + "\n\n" + tables + "\n" + END + tail)


def write_doc(results: str = RESULTS, doc: str = DOC, full: str = FULL, rl_doc: str = RL_DOC) -> None:
    # both texts before either file is opened for writing: a failing record leaves the docs as they were
    short, tables, rl = summary(results), report(results), rl_report(results)
    _replace_block(doc, short)
    _replace_block(full, tables)
    if rl:
        _replace_block(rl_doc, rl)


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    p.add_argument("--results", default=RESULTS)
    p.add_argument(
        "--write", action="store_true", help=f"replace the tables in {os.path.relpath(DOC)} and {os.path.relpath(FULL)}"
    )
    a = p.parse_args()
    if a.write:
        write_doc(a.results)
    else:
        print(report(a.results))
