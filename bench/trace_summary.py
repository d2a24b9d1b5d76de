"""GPU time of one profiled training step by kernel class, from a Chrome trace.

    python bench/trace_summary.py outputs/.../profile_traces/iteration_10/rank0_trace.json

torchtitan's profiler (`--profiling.enable_profiling`) writes one trace per profiled step;
this reads it and sums kernel durations by what they do, so a step's time can be split
between the MoE experts, dense layers, attention, the optimizer and the rest without
keeping the (large) trace file.

Where the host runs ahead of the GPU, the trace also holds the end of the step before: kernels
queued before tracing began (their launch is not in the trace) that ran inside it. They are
left out of the classes and the busy time, and summed apart (`earlier_step_ms`).

Where the GPU waits for the host, the trace shows it idle between two kernels. `idle` sums the
idle time from the step's first kernel to its last (kernels of the step before keep the GPU busy
too) and lists the longest waits, each with the kernels around it and the host op that launched
the kernel after it: the code the GPU waited for.
"""

import argparse
import bisect
import glob
import json
import os

# (class, substrings of the kernel name), first match wins
CLASSES = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn")),  # cudnn: its SDPA's helper kernels too
    ("optimizer", ("multi_tensor_apply", "adam", "foreach")),
    ("grouped_gemm", ("cutlass",)),  # torch._grouped_mm on sm90
    ("dense_gemm", ("nvjet", "gemm", "xmma", "gmma", "matmul")),
    ("sort_scan", ("sort", "radix", "scan", "cub::")),
    ("index_scatter_gather", ("index", "scatter", "gather")),
    ("reduce_norm_loss", ("reduce", "norm", "softmax", "cross_entropy", "nll", "log_softmax")),
)


def kernel_class(name: str) -> str:
    n = name.lower()
    for cls, keys in CLASSES:
        if any(k in n for k in keys):
            return cls
    return "elementwise_other"


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """The time (us intervals, -> ms) some interval covers: overlaps counted once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def _launches(events: list[dict]) -> dict:
    """Correlation id -> host time of each launch in the trace (generated (Triton) and CuTe kernels
    are launched through the driver API, the rest through the runtime's)."""
    return {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }


# an idle interval shorter than this is a kernel boundary, not a wait for the host
_IDLE_US = 20.0
_LONGEST = 8


def _host_op(ops: list[tuple[float, float, str]], ts: float) -> str:
    """The innermost host op (cpu_op or user_annotation range) running at host time ts."""
    inside = [(end - start, name) for start, end, name in ops if start <= ts <= end]
    return min(inside)[1] if inside else ""


def _idle(
    kernels: list[tuple[float, float, str, float | None]],
    ops: list[tuple[float, float, str]],
    first: float,
    last: float,
) -> dict:
    """The GPU's idle intervals between first and last (us) among kernels (start, end, name, host
    launch time), the longest with their surroundings: the kernel each wait comes after, the one
    it comes before, and the host op that launched the latter."""
    gaps, end, before = [], None, ""
    for start, stop, name, launch in sorted(kernels):
        if stop < first or start > last:
            continue
        if end is not None and start - end >= _IDLE_US:
            gaps.append((start - end, end, before, name, launch))
        if end is None or stop > end:
            end, before = stop, name
    longest = sorted(gaps, key=lambda g: -g[0])[:_LONGEST]
    return {
        "idle_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
        "waits": len(gaps),
        "longest": [
            {
                "ms": round(ms / 1e3, 3),
                "at_ms": round((at - first) / 1e3, 3),
                "after_kernel": b[:120],
                "before_kernel": a[:120],
                "launched_in": "" if launch is None else _host_op(ops, launch)[:120],
            }
            for ms, at, b, a, launch in longest
        ],
    }


def _launched_in(events: list[dict], launches: dict, prefix: str) -> set:
    """Correlation ids of the launches (_launches) made inside a host range whose name starts with
    prefix (torch's optimizers annotate their steps "Optimizer.step#<class>.step"; a container's
    range holds its optimizers' ranges)."""
    ranges = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith(prefix)
    )
    merged = []  # nested and overlapping ranges as one
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = [s for s, _ in merged]
    ids = set()
    for correlation, ts in launches.items():
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ts <= merged[i][1]:
            ids.add(correlation)
    return ids


def summarize_trace(path: str) -> dict:
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # an optimizer's kernels by where they were launched: a generated kernel's name does not say
    launched = _launches(events)
    optimizer = _launched_in(events, launched, "Optimizer.step#")
    by_class, top, spans, kernels = {}, {}, [], []
    step_ms, earlier = None, 0.0
    for e in events:
        if e.get("ph") != "X":
            continue
        name, cat, dur = e.get("name", ""), e.get("cat", ""), float(e.get("dur", 0.0))
        if name.startswith("ProfilerStep#"):
            step_ms = dur / 1e3
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            correlation = e.get("args", {}).get("correlation")
            kernels.append((float(e["ts"]), float(e["ts"]) + dur, name, launched.get(correlation)))
            if correlation is not None and correlation not in launched:
                earlier += dur / 1e3
                continue
            if cat != "kernel":
                cls = "memcpy_memset"
            elif correlation in optimizer:
                cls = "optimizer"
            else:
                cls = kernel_class(name)
            by_class[cls] = by_class.get(cls, 0.0) + dur / 1e3
            top[name] = top.get(name, 0.0) + dur / 1e3
            spans.append((float(e["ts"]), float(e["ts"]) + dur))
    ops = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
    ]
    first, last = (min(s for s, _ in spans), max(e for _, e in spans)) if spans else (0.0, 0.0)
    return {
        "step_wall_ms": step_ms,
        "gpu_busy_ms": round(union_ms(spans), 3),  # overlapping streams counted once
        "idle": _idle(kernels, ops, first, last),
        "kernel_ms_by_class": {k: round(v, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: round(v, 3) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:15]},
        "earlier_step_ms": round(earlier, 3),
    }


def find_trace(dump_folder: str) -> str | None:
    found = sorted(glob.glob(os.path.join(dump_folder, "**", "rank0_trace.json"), recursive=True))
    return found[-1] if found else None


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    print(json.dumps(summarize_trace(p.parse_args().trace), indent=1))
