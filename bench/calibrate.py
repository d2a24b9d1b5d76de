"""The planner calibrated on measured trainer runs of one lease: `python -m bench.calibrate RECORD [RECORD ...]`.

    python -m bench.calibrate bench/results/exchange_h200x2_2026-11-28_1624_tp2_batch.json \\
        bench/results/exchange_h200x2_2026-11-28_1638_foldings.json

The records are bench/train_step.py results of one model, taken in one lease (the same card).
Two of the cost model's settings are fitted, each on one run: `compute_efficiency` on the
one-GPU case (nothing crosses a GPU there), then `exchange_latency_s`, the host's wait before each
exact expert exchange, on dp2 x ep2. Every other case is then a prediction, printed beside its
measurement and beside the uncalibrated planner's estimate. A case run twice (`_rerun`) counts
with the mean of its step times.
"""

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.planned import mapping_and_work  # noqa: E402
from bench.train_step import register_proxy  # noqa: E402
from titan_fold.models import FLAVORS  # noqa: E402
from titan_fold.planning.cost_model import Cluster, estimate  # noqa: E402
from titan_fold.planning.sizes import model_sizes  # noqa: E402

ONE_GPU, FOLDED = "1gpu", "dp2_ep2"  # the cases the two settings are fitted on


@dataclass
class Case:
    name: str  # the case without "_rerun"
    row: dict
    measured_s: float  # mean step time over its runs


def cases(paths: list[str]) -> tuple[dict, list[Case]]:
    """-> (the first record's figures, each case that ran through, runs of one case merged)."""
    figures, runs = None, {}
    for path in paths:
        with open(path) as f:
            fig = json.load(f)["figures"]
        if figures is not None and (fig["family"], fig["proxy_flavor"]) != (figures["family"], figures["proxy_flavor"]):
            raise ValueError(f"{path}: another model than the first record's")
        figures = figures or fig
        for row in fig["rows"]:
            if row["returncode"] == 0 and "_profile" not in row["case"] and "_phases" not in row["case"]:
                runs.setdefault(row["case"].removesuffix("_rerun"), []).append(row)
    return figures, [Case(n, rs[0], sum(r["step_time_s"] for r in rs) / len(rs)) for n, rs in runs.items()]


def _solve(f, lo: float, hi: float) -> float:
    """x in [lo, hi] with f(x) = 0 for f increasing, by bisection."""
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def calibrate(paths: list[str]) -> tuple[Cluster, list[tuple[Case, float, float]]]:
    """-> (the fitted cluster of 2 GPUs, [(case, default estimate s, calibrated estimate s)])."""
    figures, found = cases(paths)
    register_proxy(figures["family"], figures["proxy_flavor"])
    sizes = model_sizes(FLAVORS[figures["family"]][figures["proxy_flavor"]], figures["seq_len"])
    plans = {c.name: (c, *mapping_and_work(c.row)) for c in found}

    def fitted(prefix: str) -> Case:
        hits = [c for c in found if c.name.startswith(prefix + "_") and not re.search(r"_b\d+(_|$)", c.name)]
        if len(hits) != 1:
            raise ValueError(f"need exactly one {prefix} case at the default batch to fit on, found {len(hits)}")
        return hits[0]

    def step(case: Case, cluster: Cluster) -> float:
        _, mapping, work = plans[case.name]
        return estimate(sizes, mapping, work, cluster).step_s

    default = Cluster(2, gpus_per_node=2, gpu_memory_gib=139)
    one = fitted(ONE_GPU)
    # a lower efficiency is a longer step: solve step(efficiency) = measured
    eff = _solve(lambda e: one.measured_s - step(one, replace(default, compute_efficiency=e)), 0.01, 1.0)
    folded = fitted(FOLDED)
    cluster = replace(default, compute_efficiency=eff)
    wait = _solve(lambda w: step(folded, replace(cluster, exchange_latency_s=w)) - folded.measured_s, 0.0, 0.1)
    cluster = replace(cluster, exchange_latency_s=wait)
    return cluster, [(c, step(c, default), step(c, cluster)) for c in found]


def table(paths: list[str]) -> str:
    cluster, rows = calibrate(paths)
    lines = [
        f"fitted: compute_efficiency {cluster.compute_efficiency:.3f} (on {ONE_GPU}), exchange_latency_s "
        f"{cluster.exchange_latency_s * 1e3:.2f} ms (on {FOLDED})",
        "",
        "| case | measured step s | planner, defaults | planner, fitted | fitted / measured |",
        "|---|---:|---:|---:|---:|",
    ]
    for case, default, fit in rows:
        lines.append(
            f"| {case.name} | {case.measured_s:.4f} | {default:.4f} | {fit:.4f} | {fit / case.measured_s:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="bench/train_step.py result JSONs of one lease")
    print(table(p.parse_args(argv).records))


if __name__ == "__main__":
    main()
