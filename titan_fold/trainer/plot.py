"""Plots of runs: `python -m titan_fold.plot DUMP_FOLDER [DUMP_FOLDER ...] [--out FILE.png]`.

One PNG of a run, or several overlaid: loss, gradient norm, tokens/s per device and expert
load imbalance over the steps, read from each folder's `metrics.jsonl` (a path to a .jsonl
file works too). With --expert-load, one run's per-expert load (metrics.expert_load): a layer x
expert heat map, each expert's tokens over the layer's mean, at up to four logged steps spread
over the run. Needs matplotlib (`pip install -e ".[plot]"`).
"""

import argparse
import json
import os

from titan_fold.common.errors import UserError
from titan_fold.common.pyplot import pyplot
from titan_fold.trainer.metrics_file import EXPERT_LOAD_FILE, METRICS_FILE

COMMAND = "python -m titan_fold.plot"
PANELS = [
    ("loss", "loss", False),
    ("grad_norm", "gradient norm", True),
    ("tokens_per_sec", "tokens/s per device", False),
    ("expert_load_imbalance", "expert load imbalance (max / mean)", False),
]


class PlotError(UserError):
    pass


def _by_step(path: str, name: str, missing: str) -> list[dict]:
    """The records of one run's `name` file (a folder holding it, or the file), one per step (a
    step logged again after a resume: the last record wins), in step order. A torn last line
    (a run killed while writing) is skipped. missing: what the error says to do without it."""
    file = os.path.join(path, name) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise PlotError(f"{path}: no {name} ({missing})")
    by_step = {}
    with open(file) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            by_step[record["step"]] = record
    if not by_step:
        raise PlotError(f"{file}: no records yet")
    return [by_step[s] for s in sorted(by_step)]


def read_run(path: str) -> list[dict]:
    """metrics.jsonl's records of one run, one per step, in step order."""
    return _by_step(path, METRICS_FILE, "give a run's job.dump_folder or a .jsonl file")


def run_label(path: str, paths: list[str]) -> str:
    """The shortest trailing part of the path that tells the runs apart."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    others = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in paths if p != path]
    for n in range(1, len(parts) + 1):
        if all(parts[-n:] != o[-n:] for o in others):
            return os.path.join(*parts[-n:])
    return path


def plot(paths: list[str], out: str) -> str:
    plt = pyplot(COMMAND)
    runs = {run_label(p, paths): read_run(p) for p in paths}
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    for ax, (key, title, log_scale) in zip(axes.flat, PANELS, strict=True):
        for label, records in runs.items():
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="." if len(points) < 30 else None, label=label)
        ax.set_title(title)
        if log_scale:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def read_load(path: str) -> list[dict]:
    """expert_load.jsonl's records of one run, one per step, in step order."""
    return _by_step(path, EXPERT_LOAD_FILE, "run with --metrics.expert_load")


def plot_load(path: str, out: str, panels: int = 4) -> str:
    plt = pyplot(COMMAND)
    records = read_load(path)
    picked = [records[round(i * (len(records) - 1) / max(1, panels - 1))] for i in range(min(panels, len(records)))]
    picked = list({r["step"]: r for r in picked}.values())
    fig, axes = plt.subplots(1, len(picked), figsize=(4.5 * len(picked), 3.5), squeeze=False)
    for ax, record in zip(axes[0], picked, strict=True):
        rows = [[c / (sum(row) / len(row)) if sum(row) else 0.0 for c in row] for row in record["counts"]]
        image = ax.imshow(rows, aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_title(f"step {record['step']}")
        ax.set_xlabel("expert")
        ax.set_yticks(range(len(record["layers"])), record["layers"], fontsize="small")
        fig.colorbar(image, ax=ax, label="tokens / layer mean")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m titan_fold.plot", description=__doc__.split("\n\n")[1])
    p.add_argument("runs", nargs="+", metavar="DUMP_FOLDER", help="a run's job.dump_folder (or its metrics.jsonl)")
    p.add_argument(
        "--out", default=None, help="PNG to write (default: DUMP_FOLDER/metrics.png for one run, runs.png for several)"
    )
    p.add_argument(
        "--expert-load",
        action="store_true",
        help="one run's per-expert load heat maps (default --out: DUMP_FOLDER/expert_load.png)",
    )
    args = p.parse_args(argv)
    if args.expert_load:
        if len(args.runs) != 1:
            raise PlotError(f"--expert-load draws one run; {len(args.runs)} given")
        folder = args.runs[0] if os.path.isdir(args.runs[0]) else os.path.dirname(args.runs[0])
        print(plot_load(args.runs[0], args.out or os.path.join(folder, "expert_load.png")))
        return
    out = args.out or (
        os.path.join(args.runs[0], "metrics.png") if len(args.runs) == 1 and os.path.isdir(args.runs[0]) else "runs.png"
    )
    print(plot(args.runs, out))
