"""Dry run: check a job config at its real world size on one CPU, before the cluster.

    NGPU=64 python -m titan_fold.train --job.config_file qwen2.toml --comm.mode fake_backend

torchtitan's `--comm.mode fake_backend` (a fake process group of NGPU ranks in one process)
runs this instead of training. For the simulated rank (`--comm.dry_run_rank R`, default 0;
-1: the first and the last rank of every pipeline stage) it
- runs every check a real run makes before its first step (titan_fold.trainer.preflight.CHECKS),
  failing as the real run fails (one line, exit 2);
- builds both meshes on the fake process group and reads off the rank's coordinates;
- builds the model on the meta device and applies the trainer's own pipeline split and
  parallelize (TP/SP, CP, EP x ETP, FSDP2 on both meshes): local shapes, no storage;
- counts the bytes of parameters, gradients and optimizer states of the rank;
- runs one micro-batch forward and backward of the rank's stages under fake tensors
  (shapes only, in the compute dtype) and measures the activations autograd keeps;
- puts the cost model's estimate for the same mapping beside it (titan_fold.planning.cost_model).
Then (`--comm.dry_run_collectives`, default on) every rank runs one training step of a
shrunk model (same layout, same experts and heads, tiny widths, few layers; under PP the real
pipeline schedule) while every collective is recorded per process group and every pipeline
send/recv per pair of ranks; all members of a group must issue the same sequence and every
send must meet its recv, else the first divergence is reported (the mismatch that hangs a
real job); a step that raises on a rank is reported with its cause.
Output: a table on stdout and `<job.dump_folder>/dry_run.json`; a progress line per phase on stderr.
"""

from titan_fold.dryrun.gradients import check_gradients, gradient_check
from titan_fold.dryrun.match import first_divergence
from titan_fold.dryrun.measure import build_rank, simulate_rank
from titan_fold.dryrun.record import P2P, StepFailed, record_collectives, shrunk_config
from titan_fold.dryrun.report import (
    check_config,
    doc_excerpt,
    dry_run,
    excerpt_block,
    format_report,
    main,
)
from titan_fold.dryrun.world import SharedShardingDecisions, init_fake_world

__all__ = [
    "P2P",
    "SharedShardingDecisions",
    "StepFailed",
    "build_rank",
    "check_config",
    "check_gradients",
    "doc_excerpt",
    "dry_run",
    "excerpt_block",
    "first_divergence",
    "format_report",
    "gradient_check",
    "init_fake_world",
    "main",
    "record_collectives",
    "shrunk_config",
    "simulate_rank",
]
