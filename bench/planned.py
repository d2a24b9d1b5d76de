"""The planner's estimates beside a 2-GPU record's measured trainer foldings, on the CPU:

    python -m bench.planned                  # the latest bench/results/2gpu_*.json with a foldings step
    python -m bench.planned RECORD.json

Each row of the record's `foldings` step (bench/train_step.py, one case per folding, one call)
is estimated with titan_fold.planning.cost_model at the degrees, sequence length and batch its
command ran with. docs/planning.md quotes the table; tests/test_cost_model.py checks the pairs.
"""

import glob
import json
import os
import shlex
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.common import RESULTS_DIR  # noqa: E402
from bench.train_step import register_proxy  # noqa: E402
from titan_fold.models import FLAVORS  # noqa: E402
from titan_fold.planning.cost_model import Cluster, Estimate, Mapping, Workload, estimate  # noqa: E402
from titan_fold.planning.sizes import model_sizes  # noqa: E402

STEP = "foldings"


@dataclass
class Pair:
    row: dict  # the record's row: case, folding, peak_memory_gib (max reserved), step_time_s, ...
    mapping: Mapping
    work: Workload
    estimate: Estimate

    @property
    def tokens_per_step(self) -> int:
        return self.work.global_batch * self.work.seq_len


def _option(words: list[str], key: str, default: str | None = None) -> str:
    if key in words:
        return words[words.index(key) + 1]
    if default is None:
        raise ValueError(f"the row's command has no {key}")
    return default


def latest_record() -> str:
    """The newest bench/results/2gpu_*.json (by its date) whose foldings step has rows."""
    found = []
    for path in glob.glob(os.path.join(RESULTS_DIR, "2gpu_*.json")):
        with open(path) as f:
            record = json.load(f)
        if record["figures"].get(STEP, {}).get("rows"):
            found.append((record["date_utc"], path))
    if not found:
        raise FileNotFoundError(f"no {RESULTS_DIR}/2gpu_*.json has a {STEP} step: run `python -m bench 2gpu` on 2 GPUs")
    return max(found)[1]


def mapping_and_work(row: dict) -> tuple[Mapping, Workload]:
    """The planner's mapping and workload of a trainer case: the degrees, sequence length and batch
    its command ran with."""
    words = shlex.split(row["command"])
    deg = {
        k: int(_option(words, f"--parallelism.{k}_degree"))
        for k in (
            "pipeline_parallel",
            "data_parallel_shard",
            "context_parallel",
            "tensor_parallel",
            "expert_parallel",
            "expert_tensor_parallel",
            "expert_data_parallel",
        )
    }
    pp = deg["pipeline_parallel"]
    if deg["expert_data_parallel"] < 0:  # -1: whatever the expert mesh leaves (the trainer's default)
        deg["expert_data_parallel"] = row["nproc"] // (pp * deg["expert_parallel"] * deg["expert_tensor_parallel"])
    mapping = Mapping(
        pp,
        1,
        deg["data_parallel_shard"],
        deg["context_parallel"],
        deg["tensor_parallel"],
        deg["expert_parallel"],
        deg["expert_tensor_parallel"],
        deg["expert_data_parallel"],
    )
    local = int(_option(words, "--training.local_batch_size"))
    # a pipeline splits the local batch into micro-batches (torchtitan's default size 1); else one pass
    micro = int(_option(words, "--parallelism.pipeline_parallel_microbatch_size", "1")) if pp > 1 else local
    work = Workload(
        int(_option(words, "--training.seq_len")),
        int(_option(words, "--training.global_batch_size")),
        micro_batch=micro,
    )
    return mapping, work


def pairs(path: str) -> tuple[dict, list[Pair]]:
    """-> (the record, its foldings' rows that ran through, each with the planner's estimate)."""
    with open(path) as f:
        record = json.load(f)
    fig = record["figures"][STEP]
    register_proxy(fig["family"], fig["proxy_flavor"])
    sizes = model_sizes(FLAVORS[fig["family"]][fig["proxy_flavor"]], fig["seq_len"])
    memory_gib = 139 if "H200" in record["env"]["device"] else 80
    out = []
    for row in fig["rows"]:
        if row["returncode"] != 0:
            continue
        words = shlex.split(row["command"])
        if _option(words, "--training.dtype", "float32") != "float32" or fig["mixed_precision_param"] != "bfloat16":
            # the planner's 16 bytes per parameter: fp32 weights, gradients and moments, bf16 compute
            raise ValueError(f"{row['case']}: the planner models fp32 weights with bf16 compute only")
        mapping, work = mapping_and_work(row)
        cluster = Cluster(row["nproc"], gpus_per_node=row["nproc"], gpu_memory_gib=memory_gib)
        out.append(Pair(row, mapping, work, estimate(sizes, mapping, work, cluster)))
    return record, out


def table(path: str) -> str:
    record, found = pairs(path)
    fig = record["figures"][STEP]
    lines = [
        f"{os.path.relpath(path, os.path.dirname(HERE))}: {record['env']['device_count']} x "
        f"{record['env']['device']}, {record['date_utc'][:10]}; {fig['family']} {fig['proxy_flavor']}, "
        f"seq {fig['seq_len']}, local batch {fig['local_batch']}",
        "",
        "| case | tokens / step | measured GiB | planner GiB (dropless worst) | planner / measured "
        "| measured step s | planner step s | planner / measured | measured tok/s/GPU | planner tok/s/GPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in found:
        r, e, gpus = p.row, p.estimate, p.row["nproc"]
        gib, worst = e.memory.total / 2**30, e.memory.total_worst_dropless / 2**30
        lines.append(
            f"| {r['case']} | {p.tokens_per_step} | {r['peak_memory_gib']:.1f} | {gib:.1f} ({worst:.1f}) "
            f"| {gib / r['peak_memory_gib']:.3f} | {r['step_time_s']:.4f} | {e.step_s:.4f} "
            f"| {e.step_s / r['step_time_s']:.2f} | {p.tokens_per_step / r['step_time_s'] / gpus:,.0f} "
            f"| {p.tokens_per_step / e.step_s / gpus:,.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1] if len(sys.argv) > 1 else latest_record()))
