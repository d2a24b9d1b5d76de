"""Markdown tables of the benchmark results (the tables of docs/benchmarks.md).

    python bench/report.py [--results bench/results] > /tmp/tables.md

Reads the JSON files the benchmarks wrote; a missing file leaves its table out.
"""

import argparse
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(results: str, name: str):
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _all(results: str, prefix: str) -> list[tuple[str, dict]]:
    """Every result whose name starts with prefix, oldest first: (name, record)."""
    names = [os.path.basename(p)[:-5] for p in glob.glob(os.path.join(results, f"{prefix}*.json"))]
    recs = [(n, _load(results, n)) for n in names]
    return sorted(recs, key=lambda nr: (nr[1].get("date_utc", ""), nr[0]))


def _f(x, digits=1):
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _dispatch(row: dict) -> str:
    return row["dispatch"] + ("" if row.get("shared_overlap", True) else ", shared expert not overlapped")


def moe_layer_table(results: str) -> list[str]:
    rows = []
    for name in ("moe_layer_eager", "moe_layer_compiled", "moe_layer_2gpu", "moe_layer_2gpu_overlap"):
        rec = _load(results, name)
        if rec:
            dense = rec["figures"]["dense_bf16_gemm_tflops"]
            rows += [(r, dense) for r in rec["figures"]["rows"]]
    if not rows:
        return []
    out = ["| shape | mode | dispatch | eager/compiled | ms / step | TFLOP/s | dense GEMM TFLOP/s | ratio | kept |",
           "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r, dense in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | {r['mode']} | {_dispatch(r)} | {'compiled' if r['compiled'] else 'eager'} "
                       f"| error: {r['error'][:60]} | | | | |")
            continue
        out.append(f"| {r['shape']} | {r['mode']} | {_dispatch(r)} | {'compiled' if r['compiled'] else 'eager'} | "
                   f"{_f(r['median_ms'], 2)} | {_f(r['tflops'])} | {_f(dense)} | {_f(r.get('ratio_to_dense_gemm'), 3)} | "
                   f"{_f(r['kept_frac'], 3)} |")
    return out


ROUND2 = ("moe_layer_n_", "moe_layer_o_", "moe_layer_p_", "moe_layer_q")  # issue 18's calls (phases N-Q)


def moe_layer_round2_table(results: str) -> list[str]:
    """Every MoE-layer row of phases N to Q: titan_fold's layer (code of that call, or $BASE,
    the code before it, in *_base_* files) and torchtitan 0.2.2's, each with the dense GEMM
    rate of its own process."""
    out = ["| result | layer | shape | eager/compiled | ms / step | TFLOP/s | dense GEMM TFLOP/s | share of dense | "
           "torchtitan ms / titan_fold ms |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    n = 0
    for prefix in ROUND2:
        for name, rec in _all(results, prefix):
            rows, dense = rec["figures"]["rows"], rec["figures"]["dense_bf16_gemm_tflops"]
            theirs = {(r["shape"], r["compiled"]): r.get("median_ms") for r in rows if r.get("impl") == "torchtitan"}
            for r in rows:
                if "error" in r:
                    continue
                layer = r.get("impl", "titan_fold") + (" ($BASE)" if "_base_" in name else "")
                vs = theirs.get((r["shape"], r["compiled"])) if r.get("impl") == "titan_fold" else None
                out.append(f"| {name} | {layer} | {r['shape']} | {'compiled' if r['compiled'] else 'eager'} | "
                           f"{_f(r['median_ms'], 3)} | {_f(r['tflops'])} | {_f(dense)} | "
                           f"{_f(r.get('ratio_to_dense_gemm'), 3)} | {_f(vs / r['median_ms'], 2) if vs else '-'} |")
                n += 1
    return out if n else []


def kernel_class_table(results: str) -> list[str]:
    """GPU time of one eager forward + backward by kernel class, phases N to Q."""
    classes = ("gemm", "index_scatter_gather", "triton_fused", "add", "mul", "reduce", "elementwise_other", "sort_scan")
    out = ["| result | layer | shape | step ms | GPU busy ms | kernels | " + " | ".join(classes) + " |",
           "|---|---|---|---:|---:|---:|" + "---:|" * len(classes)]
    n = 0
    for prefix in ROUND2:
        for name, rec in _all(results, prefix):
            for r in rec["figures"]["rows"]:
                b = r.get("breakdown")
                if not b:
                    continue
                cls = b["step_gpu_ms_by_kernel_class"]
                layer = r.get("impl", "titan_fold") + (" ($BASE)" if "_base_" in name else "")
                out.append(f"| {name} | {layer} | {r['shape']} | {_f(r['median_ms'], 2)} | {_f(b['step_gpu_busy_ms'], 2)} | "
                           f"{_f(b.get('kernels_per_step'), 0)} | " + " | ".join(_f(cls.get(c), 2) if cls.get(c) else "-"
                                                                                 for c in classes) + " |")
                n += 1
    return out if n else []


def breakdown_table(results: str) -> list[str]:
    parts = ("router", "permute_sort", "count_exchange", "all_to_all", "all_gather_v", "grouped_gemm",
             "reduce_scatter_v", "dispatcher_rest_gather_combine", "shared_expert")
    classes = ("gemm", "nccl", "index_scatter_gather", "elementwise_other", "sort_scan", "reduce")
    out = ["| shape | mode | dispatch | step ms | " + " | ".join(f"fwd {p}" for p in parts) + " | "
           + " | ".join(f"step {c}" for c in classes) + " |",
           "|---|---|---|---:|" + "---:|" * (len(parts) + len(classes))]
    n = 0
    for name in ("moe_layer_eager", "moe_layer_2gpu"):
        rec = _load(results, name)
        for r in (rec or {}).get("figures", {}).get("rows", []):
            b = r.get("breakdown")
            if not b:
                continue
            fwd, cls = b["forward_ms_by_part"], b["step_gpu_ms_by_kernel_class"]
            out.append(f"| {r['shape']} | {r['mode']} | {_dispatch(r)} | {_f(r['median_ms'], 1)} | "
                       + " | ".join(_f(fwd.get(p), 2) if fwd.get(p) else "-" for p in parts) + " | "
                       + " | ".join(_f(cls.get(c), 1) if cls.get(c) else "-" for c in classes) + " |")
            n += 1
    return out if n else []


def train_table(results: str) -> list[str]:
    out = ["| result | run | GPUs | attention | experts (ep, etp, edp) | tokens/s per GPU | TFLOP/s per GPU | MFU % | "
           "peak memory GiB | step s | loss first -> last |",
           "|---|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    n = 0
    for name, rec in _all(results, "train_step_"):
        for r in rec.get("figures", {}).get("rows", []):
            fold = r.get("folding")
            experts = f"{fold['ep']}, {fold['etp']}, {fold['edp']}" if fold else "-"
            status = "" if r["returncode"] == 0 else f" (rc {r['returncode']})"
            out.append(f"| {name} | {r['case']}{status} | {r['nproc']} | {_attention(r)} | "
                       f"{experts} | {_f(r['tokens_per_sec_per_gpu'], 0)} | {_f(r['tflops_per_gpu'])} | "
                       f"{_f(r['mfu_pct'])} | {_f(r['peak_memory_gib'])} | {_f(r['step_time_s'], 3)} | "
                       f"{_f(r['loss_first'], 2)} -> {_f(r['loss_last'], 2)} |")
            n += 1
    return out if n else []


def _attention(row: dict) -> str:
    fold = row.get("folding") or {}
    if fold.get("tp", 1) > 1:
        return f"tp{fold['tp']} SP"
    if fold.get("cp", 1) > 1:
        return f"cp{fold['cp']}"
    if fold.get("pp", 1) > 1:
        return f"pp{fold['pp']}"
    return f"dp{row['nproc']} FSDP" if row["nproc"] > 1 else "single"


def profile_table(results: str) -> list[str]:
    rows = [r for _, rec in _all(results, "train_step_") for r in rec.get("figures", {}).get("rows", [])
            if r.get("trace_summary")]
    if not rows:
        return []
    out = ["| run | step wall ms | GPU busy ms | kernel class | ms | share of step |", "|---|---:|---:|---|---:|---:|"]
    for r in rows:
        t = r["trace_summary"]
        for i, (cls, ms) in enumerate(t["kernel_ms_by_class"].items()):
            head = f"| {r['case']} | {_f(t['step_wall_ms'])} | {_f(t['gpu_busy_ms'])} " if i == 0 else "| | | "
            out.append(head + f"| {cls} | {_f(ms)} | {_f(100 * ms / t['step_wall_ms'])}% |")
    return out


def vs_table(results: str) -> list[str]:
    out = ["| result | case | torchtitan tokens/s | torchtitan MFU % (its count / ours) | titan_fold tokens/s | "
           "titan_fold MFU % | ratio titan_fold / torchtitan | torchtitan peak GiB |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    n = 0
    for name, rec in _all(results, "vs_torchtitan_"):
        for r in rec.get("figures", {}).get("rows", []):
            out.append(f"| {name} | {r['case']} | {_f(r['tokens_per_sec_per_gpu'], 0)} | {_f(r['mfu_pct'])} / "
                       f"{_f(r.get('mfu_pct_titan_fold_formula'))} | {_f(r.get('titan_fold_tokens_per_sec'), 0)} | "
                       f"{_f(r.get('titan_fold_mfu_pct'))} | {_f(r.get('ratio_titan_fold_over_torchtitan'), 3)} | "
                       f"{_f(r['peak_memory_gib'])} |")
            n += 1
    return out if n else []


def row_movement_table(results: str) -> list[str]:
    rec = _load(results, "row_movement")
    if not rec:
        return []
    out = ["| shape | rows MiB | indexing ms | embedding_bag ms | gather_sum ms | dispatcher ms | dispatcher speedup |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rec["figures"]["rows"]:
        out.append(f"| {r['shape']} | {_f(r['row_bytes_mib'], 0)} | {_f(r['indexing_ms'], 2)} | "
                   f"{_f(r['embedding_bag_ms'], 2)} | {_f(r['gather_sum_ms'], 2)} | {_f(r['dispatcher_ms'], 2)} | {_f(r['dispatcher_speedup'], 2)} |")
    return out


def collectives_table(results: str) -> list[str]:
    rec = _load(results, "collectives")
    if not rec:
        return []
    cases = ("raw_all_to_all", "dispatcher_a2a_even", "dispatcher_a2a_uneven", "raw_all_gather", "dispatcher_all_gather_v")
    out = ["| payload | buffer MiB | " + " | ".join(f"{c} GB/s (ms)" for c in cases)
           + " | a2a dispatcher/raw | all-gather dispatcher/raw |",
           "|---|---:|" + "---:|" * (len(cases) + 2)]
    for r in rec["figures"]["rows"]:
        out.append(f"| {r['payload']} | {_f(r['buffer_mib'])} | "
                   + " | ".join(f"{_f(r[c]['out_GBps'])} ({_f(r[c]['median_ms'], 3)})" for c in cases)
                   + f" | {_f(r['dispatcher_over_raw_a2a'], 2)} | {_f(r['dispatcher_over_raw_all_gather'], 2)} |")
    return out


def ep_share_table(results: str) -> list[str]:
    """moe_layer.py --ep-rank-share: each shape's step time against its balanced (0.5) row."""
    rows = [r for _, rec in _all(results, "moe_layer_2gpu_") for r in rec["figures"]["rows"]
            if r.get("ep_rank_share_asked") and "error" not in r]
    if not rows:
        return []
    balanced = {r["shape"]: r["median_ms"] for r in rows if r["ep_rank_share_asked"] == "0.5"}
    out = ["| shape | share asked of EP rank 0 | share measured | ms / step | against share 0.5 | "
           "busiest rank's routed rows against 0.5 |",
           "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        base = balanced.get(r["shape"])
        share = r["ep_rank0_share"]
        out.append(f"| {r['shape']} | {r['ep_rank_share_asked']} | {_f(share, 3)} | {_f(r['median_ms'], 2)} | "
                   f"{_f(r['median_ms'] / base if base else None, 3)} | {_f(max(share, 1 - share) / 0.5, 2)} |")
    return out


def grouped_gemm_table(results: str) -> list[str]:
    """bench/grouped_gemm.py: each routed grouped GEMM's TFLOP/s alone, bmm on equal groups,
    the share of the dense rate the routed GEMMs allow, the stacked-w13 experts against ours."""
    gemms = ("up_fwd", "up_dgrad", "up_wgrad", "down_fwd", "down_dgrad", "down_wgrad")
    out = ["| result | shape | dense GEMM TFLOP/s | " + " | ".join(g.replace("_", " ") for g in gemms)
           + " | bmm up fwd / wgrad | bmm down fwd / wgrad | routed GEMMs TFLOP/s | gemm_bound_share | with shared | "
           "experts fwd+bwd ms (ours) | stacked w13 / ours | max-autotune best: TFLOP/s (share) |",
           "|---|---|---:|" + "---:|" * (len(gemms) + 8)]
    n = 0
    for name, rec in _all(results, "grouped_gemm"):
        dense = rec["figures"]["dense_bf16_gemm_tflops"]
        for r in rec["figures"]["rows"]:
            if "error" in r:
                out.append(f"| {name} | {r['shape']} | error: {r['error'][:60]} |" + " |" * (len(gemms) + 8))
                continue
            bmm = r["bmm_equal_groups"]
            e = r["experts_fwd_bwd"]
            best = (f"{_f(r['autotune_best_routed_gemms_tflops'])} ({_f(r['autotune_best_gemm_bound_share'], 3)})"
                    if "autotune" in r else "-")
            out.append(f"| {name} | {r['shape']} | {_f(dense)} | " + " | ".join(_f(r["gemms"][g]["tflops"]) for g in gemms)
                       + f" | {_f(bmm['up_fwd']['tflops'])} / {_f(bmm['up_wgrad']['tflops'])} | "
                       f"{_f(bmm['down_fwd']['tflops'])} / {_f(bmm['down_wgrad']['tflops'])} | "
                       f"{_f(r['routed_gemms_tflops'])} | {_f(r['gemm_bound_share'], 3)} | "
                       f"{_f(r['gemm_bound_share_with_shared'], 3)} | {_f(e['separate_ms'], 2)} | "
                       f"{_f(e['stacked_over_separate'], 3)} | {best} |")
            n += 1
    return out if n else []


def report(results: str) -> str:
    sections = [("MoE layer, forward + backward", moe_layer_table), ("MoE layer breakdown (ms)", breakdown_table),
                ("MoE layer beside torchtitan 0.2.2's, issue 18 (1 GPU)", moe_layer_round2_table),
                ("MoE layer GPU time by kernel class, issue 18 (ms per step)", kernel_class_table),
                ("MoE layer at ep2, a set share of the routed assignments on EP rank 0 (2 GPUs)", ep_share_table),
                ("Trainer, proxy Qwen2-57B-A14B-L2", train_table),
                ("Profiled trainer steps", profile_table),
                ("titan_fold vs torchtitan 0.2.2", vs_table),
                ("Routed grouped GEMMs alone: the bound they set (1 GPU)", grouped_gemm_table),
                ("Row movement, dispatch + combine forward + backward (1 GPU)", row_movement_table),
                ("Collectives (2 GPUs)", collectives_table)]
    text = []
    for title, fn in sections:
        lines = fn(results)
        if lines:
            text += [f"### {title}", ""] + lines + [""]
    return "\n".join(text)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    print(report(p.parse_args().results))
