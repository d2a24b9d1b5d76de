"""Shared helpers for tests that launch the trainer with torchrun."""

import json
import os
import subprocess
import sys

import pytest


def torchrun(nproc: int, *args: str, config: str = "debug_moe.toml") -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "titan_fold.train", "--job.config_file", config, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def read_metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory) -> str:
    """Initial weights of the debug model, made once on one rank (torchtitan's seed flow)."""
    root = tmp_path_factory.mktemp("seed")
    torchrun(1, "--job.dump_folder", str(root), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    return str(root / "checkpoint" / "step-0")
