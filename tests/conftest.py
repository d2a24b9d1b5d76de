"""Shared helpers for tests that launch the trainer on several CPU ranks."""

import json
import os
import subprocess
import sys
import tempfile

import pytest
from launcher import ZYGOTE


def torchrun(nproc: int, *args: str, config: str = "debug_moe.toml", fork: bool = True) -> None:
    """`torchrun --standalone --nproc_per_node NPROC -m titan_fold.train --job.config_file CONFIG ARGS`.

    fork (the default): the ranks are forked from one process that imported the trainer
    once per session, with torchrun's environment (tests/launcher.py); False: torchrun itself.
    """
    argv = ["--job.config_file", config, *args]
    if not fork:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "titan_fold.train", *argv]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        return
    with tempfile.TemporaryDirectory() as logs:
        out, err = os.path.join(logs, "stdout"), os.path.join(logs, "stderr")
        codes = ZYGOTE.launch(nproc, argv, out, err)
        if any(codes):
            tail = open(out, errors="replace").read()[-3000:] + open(err, errors="replace").read()[-6000:]
            raise AssertionError(f"exit codes {codes}\n{tail}")


def read_metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_from_seed(folder, nproc: int, seed_checkpoint: str, steps: int, *args: str, fork: bool = True) -> list[dict]:
    """Train `steps` steps from the seed checkpoint, logging every step; -> the metrics."""
    torchrun(nproc, "--job.dump_folder", str(folder), "--checkpoint.enable", "--checkpoint.initial_load_path",
             seed_checkpoint, "--checkpoint.interval", "1000", "--training.steps", str(steps),
             "--metrics.log_freq", "1", *args, fork=fork)
    return read_metrics(folder)


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory) -> str:
    """Initial weights of the debug model, made once on one rank (torchtitan's seed flow)."""
    root = tmp_path_factory.mktemp("seed")
    torchrun(1, "--job.dump_folder", str(root), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    return str(root / "checkpoint" / "step-0")


@pytest.fixture(scope="session")
def one_rank_reference(tmp_path_factory, seed_checkpoint) -> list[dict]:
    """5 steps on one rank from the seed checkpoint: the global batch of 8 sequences in 8
    micro-batches of one (so each MoE aux loss is a mean over one sequence, as in the
    folded runs that compare against it)."""
    return train_from_seed(tmp_path_factory.mktemp("ref"), 1, seed_checkpoint, 5,
                           "--training.local_batch_size", "1", "--training.global_batch_size", "8")
