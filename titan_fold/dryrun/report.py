"""The whole dry run of a job config: checks, measured ranks, recorded collectives, the table, the JSON and the excerpt docs/dryrun.md quotes."""

import dataclasses
import json
import logging
import os
import sys
import time
from collections import defaultdict
from typing import Any

import torch.distributed as dist
from torchtitan.tools.logging import logger

from titan_fold.common.config import parse_args
from titan_fold.common.errors import UserError
from titan_fold.dryrun.gradients import format_gradients, gradient_check
from titan_fold.dryrun.match import first_divergence
from titan_fold.dryrun.measure import compare, cost_model_estimate, simulate_rank
from titan_fold.dryrun.record import StepFailed, record_collectives, shrunk_config
from titan_fold.dryrun.world import positions
from titan_fold.parallel.mesh import Layout
from titan_fold.planning.accounting import GIB
from titan_fold.trainer.preflight import model_args_from_config, preflight


def check_config(job_config, world_size: int) -> tuple[Layout, Any, list[str]]:
    """Every check of a real run's preflight (preflight.CHECKS), failing as the real run fails;
    a tokenizer folder missing on this machine and a Hub dataset are warnings (the cluster has them)."""

    warnings: list[str] = []
    layout = preflight(job_config, world_size, not_checked=warnings)
    _, model_args = model_args_from_config(job_config)
    model_args.update_from_config(job_config)
    return layout, model_args, warnings


def _quiet(line: str) -> None:
    pass


def _progress(line: str) -> None:
    print(f"dry run: {line}", file=sys.stderr, flush=True)


def dry_run(
    job_config, world_size: int, ranks: list[int] | None = None, collectives: bool = True, progress=_quiet
) -> dict:
    """The report of a dry run (see the module docstring); ranks None = comm.dry_run_rank;
    progress(line): called as each phase ends."""
    t0 = time.process_time()
    layout, model_args, warnings = check_config(job_config, world_size)
    progress("checks done")
    if ranks is None:
        choice = job_config.comm.dry_run_rank
        if not -1 <= choice < world_size:
            raise UserError(f"comm.dry_run_rank = {choice}: must be a rank in [0, {world_size}) or -1 (every position)")
        ranks = positions(layout) if choice == -1 else [choice]
    est, info = cost_model_estimate(job_config, layout, model_args)
    report = {
        "config": job_config.job.config_file,
        "model": f"{job_config.model.name}/{job_config.model.flavor}",
        "world_size": world_size,
        "attention_mesh": layout.degrees("attention"),
        "expert_mesh": layout.degrees("expert"),
        "experts_per_rank": model_args.moe.num_experts // layout.ep,
        "warnings": warnings,
        "cost_model": {k: v for k, v in dataclasses.asdict(est).items()},
        "ranks": [],
    }
    if job_config.compile.enable:
        warnings.append("compile.enable: the dry run builds and measures the eager model")
    measured: dict = {}  # ranks alike in stages and local shapes step once
    for r in ranks:
        rep = simulate_rank(job_config, world_size, r, model_args, progress=progress, measured=measured)
        rep["compare"] = compare(rep, est, info, layout)
        report["ranks"].append(rep)
    progress(f"memory measured on {len(ranks)} rank{'s' if len(ranks) > 1 else ''}")
    check = gradient_check(job_config, world_size, model_args) if job_config.comm.check_gradients else None
    if collectives or check is not None:
        t1 = time.process_time()
        # without the collective check, the gradient check's step runs on one rank per position
        step_ranks = None if collectives else positions(layout)
        where = (
            f"on all {world_size} ranks"
            if collectives
            else (f"on ranks {step_ranks} (one per position; comm.dry_run_collectives off: collectives not matched)")
        )
        col = report["collectives"] = {
            "note": "a shrunk model (same layout, experts, top-k and heads; tiny widths, "
            f"{shrunk_config(job_config, model_args)[1].n_layers} layers) {where}"
            + ("; pipeline send/recv matched per pair of ranks" if layout.pp > 1 and collectives else ""),
            "matched": collectives,
            "step_failed": None,
            "first_divergence": None,
        }
        progress(f"recording one step's collectives on {len(step_ranks or range(world_size))} ranks")
        try:
            per_group = record_collectives(
                job_config,
                world_size,
                model_args,
                ranks=step_ranks,
                watch=check.watch if check is not None else None,
                progress=progress,
            )
        except StepFailed as e:
            col["step_failed"] = e.report
        else:
            col.update(
                groups=len(per_group),
                calls=sum(len(c) for g in per_group.values() for c in g.values()),
                by_kind=_count_kinds(per_group),
                optimizer_calls=_optimizer_calls(per_group),
                first_divergence=first_divergence(per_group) if collectives else None,
            )
            if check is not None:
                report["gradients"] = check.report()
        col["cpu_seconds"] = round(time.process_time() - t1, 2)
    if dist.is_initialized():
        dist.destroy_process_group()
    report["cpu_seconds"] = round(time.process_time() - t0, 2)
    return report


def _count_kinds(per_group: dict) -> dict:
    """Calls per group name and op on one member of each group (the first recorded)."""
    out: dict[str, int] = defaultdict(int)
    for (desc, _), by_rank in per_group.items():
        calls = next(iter(by_rank.values()))
        for c in calls:
            out[f"{desc or 'group'}: {c['op']}"] += 1
    return dict(sorted(out.items()))


OPTIMIZER_SITES = ("parallel/orthogonalize.py", "trainer/muon.py", "trainer/optimizer.py")


def _optimizer_calls(per_group: dict) -> dict:
    """The optimizer step's own collectives (issued from the optimizers' code) on one member of
    each group: {op: calls}."""
    out: dict[str, int] = defaultdict(int)
    for by_rank in per_group.values():
        for c in next(iter(by_rank.values())):
            if c.get("site", "").startswith(OPTIMIZER_SITES):
                out[c["op"]] += 1
    return dict(sorted(out.items()))


def _gib(b: float) -> str:
    return f"{b / GIB:8.2f}"


def format_report(report: dict) -> str:
    att = " x ".join(f"{k} {v}" for k, v in report["attention_mesh"].items())
    exp = " x ".join(f"{k} {v}" for k, v in report["expert_mesh"].items())
    lines = [
        f"dry run: {report['model']} on {report['world_size']} ranks ({os.path.basename(report['config'])})",
        f"  attention mesh: {att}",
        f"  expert mesh:    {exp}; {report['experts_per_rank']} experts per rank",
    ]
    lines += [f"  warning: {w}" for w in report["warnings"]]
    for rep in report["ranks"]:
        c = rep["coordinates"]
        lines.append("")
        lines.append(
            f"rank {rep['rank']}: attention "
            + " ".join(f"{k}={v}" for k, v in c["attention"].items())
            + " | expert "
            + " ".join(f"{k}={v}" for k, v in c["expert"].items())
        )
        for s in rep["stages"]:
            lines.append(f"  stage {s['index']} of {s['of']}: {s['modules']}")
        lines.append(f"  {'parameters by kind':<22} {'local numel':>14}  local shapes")
        for kind, k in sorted(rep["kinds"].items()):
            shapes = ", ".join(f"{n} {'x'.join(map(str, sh))}" for n, sh in list(k["shapes"].items())[:4])
            more = len(k["shapes"]) - 4
            lines.append(f"  {kind:<22} {k['numel']:>14,}  {shapes}{f' (+{more})' if more > 0 else ''}")
        acts = rep.get("activations", {})
        lines.append(f"  {'memory (GiB)':<22} {'dry run':>8} {'cost model':>11} {'diff':>7}")
        for row in rep["compare"]:
            lines.append(
                f"  {row['what']:<22} {_gib(row['dry_run'])} {_gib(row['cost_model']):>11} {100 * row['diff']:>+6.0f}%"
            )
        if "per_microbatch" in acts:
            lines.append(
                f"  activations: {acts['source']}"
                + (f" (rank {acts['as_rank']}'s: the same stages and local shapes)" if "as_rank" in acts else "")
                + f", {acts['per_microbatch'] / GIB:.2f} GiB per micro-batch; "
                f"peak of forward + backward {acts['peak'] / GIB:.2f} GiB"
            )
        else:
            lines.append(f"  activations: {acts.get('source', 'not measured')}")
        if "muon" in rep:
            mu = rep["muon"]
            lines.append(
                f"  optimizer: Muon orthogonalizes {mu['numel']:,} local elements (momentum "
                f"{mu['momentum_bytes'] / GIB:.2f} GiB); each step sends {mu['sent_bytes'] / GIB:.2f} GiB "
                "to their owners and back"
            )
        for row in rep["compare"]:
            if row["note"]:
                lines.append(f"  note on {row['what']} ({100 * row['diff']:+.0f}%): {row['note']}")
        lines.append(f"  ({rep['cpu_seconds']:.1f} CPU s)")
    col = report.get("collectives")
    if col and col["step_failed"]:
        f = col["step_failed"]
        lines += [
            "",
            f"collectives of one step: {col['note']}",
            f"  THE STEP FAILS on rank {f['rank']}: {f['error']} at {f['site']} (raised in {f['innermost']})",
        ]
    elif col:
        lines.append("")
        lines.append(f"collectives of one step: {col['calls']} calls in {col['groups']} process groups; {col['note']}")
        if col.get("optimizer_calls"):
            ops = ", ".join(f"{op} x {n}" for op, n in col["optimizer_calls"].items())
            lines.append(f"  the optimizer step's own, one member of each group: {ops}")
        div = col["first_divergence"]
        if col["matched"] and div is None:
            lines.append("  every member of every group issues the same sequence")
        elif col["matched"]:
            lines.append(
                f"  MISMATCH in group {div['group']} {div['ranks'][:8]}{'...' if len(div['ranks']) > 8 else ''}, "
                f"call {div['call']}: rank {div['rank']} issues {div['rank_issued']}; "
                f"rank {div['reference_rank']} issues {div['reference_issued']}"
            )
    if "gradients" in report:
        lines += ["", *format_gradients(report["gradients"])]
    lines.append(f"({report['cpu_seconds']:.1f} CPU s in all)")
    return "\n".join(lines)


def main(job_config) -> int:
    """`--comm.mode fake_backend`: the dry run of this job at NGPU ranks."""
    if job_config.comm.mode == "local_tensor":
        raise UserError(
            "comm.mode = 'local_tensor': not supported, FSDP2 fails under torch's LocalTensorMode "
            "(docs/planning.md, 'Dry run'); use comm.mode = 'fake_backend'"
        )
    ngpu = os.environ.get("NGPU")
    if ngpu is None or not ngpu.isdigit() or int(ngpu) < 1:
        raise UserError(f"comm.mode = 'fake_backend' needs NGPU=<world size> in the environment (got {ngpu!r})")
    level = logger.level
    if not job_config.comm.dry_run_verbose:
        # the simulated ranks' set-up lines, NGPU times over; the report says what matters
        logger.setLevel(logging.ERROR)
    try:
        report = dry_run(job_config, int(ngpu), collectives=job_config.comm.dry_run_collectives, progress=_progress)
    finally:
        logger.setLevel(level)
    print(format_report(report), flush=True)
    path = job_config.comm.dry_run_json or os.path.join(job_config.job.dump_folder, "dry_run.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {path}", flush=True)
    col = report.get("collectives", {})
    mismatched = report.get("gradients", {}).get("mismatches")
    return 1 if col.get("first_divergence") or col.get("step_failed") or mismatched else 0


EXCERPT_COMMAND = (
    "NGPU=64 python -m titan_fold.train --job.config_file qwen2.toml --comm.mode fake_backend "
    "--comm.no-dry_run_collectives"
)
EXCERPT_BEGIN = (
    "<!-- dry-run excerpt: written by `python -m titan_fold.dryrun --update-docs`, checked by tests/test_dryrun.py -->"
)
EXCERPT_END = "<!-- end of dry-run excerpt -->"


def doc_excerpt() -> str:
    """docs/dryrun.md's example: qwen2.toml at 64 ranks, rank 0; the CPU time lines (they vary)
    left out."""

    config = parse_args(["--job.config_file", "qwen2.toml", "--comm.mode", "fake_backend"])
    report = dry_run(config, 64, collectives=False)
    lines = [line for line in format_report(report).splitlines() if "CPU s" not in line]
    return "\n".join(lines)


def excerpt_block(excerpt: str) -> str:
    return (
        f"{EXCERPT_BEGIN}\n\n    $ {EXCERPT_COMMAND}\n"
        + "".join(f"    {line}\n" if line else "\n" for line in excerpt.splitlines())
        + f"\n{EXCERPT_END}"
    )


def update_doc(path: str) -> None:
    with open(path) as f:
        text = f.read()
    start, end = text.index(EXCERPT_BEGIN), text.index(EXCERPT_END) + len(EXCERPT_END)
    with open(path, "w") as f:
        f.write(text[:start] + excerpt_block(doc_excerpt()) + text[end:])
