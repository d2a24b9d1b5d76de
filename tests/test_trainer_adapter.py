"""FoldTrainer runs torchtitan's Trainer code without changing torchtitan's modules, so two
trainers built one after the other in one process (as tests and notebooks do) each run as
if alone: the second reproduces the first's losses and gradient norms step for step."""

import os
import socket

import pytest
import torch.distributed as dist
import torchtitan.components.checkpoint as tt_checkpoint
import torchtitan.components.metrics as tt_metrics
import torchtitan.distributed.utils as tt_dist_utils
import torchtitan.tools.utils as tt_utils
from conftest import read_metrics

from titan_fold.common.config import parse_args
from titan_fold.trainer.fold_trainer import FoldTrainer

# the module attributes titan_fold used to assign (torchtitan_adapter.py lists why they matter)
WATCHED = [(tt_utils, "device_type"), (tt_utils, "device_module"), (tt_dist_utils, "device_type"),
           (tt_dist_utils, "clip_grad_norm_"), (tt_dist_utils, "maybe_enable_amp"), (tt_dist_utils, "set_pg_timeouts"),
           (tt_checkpoint.CheckpointManager, "dcp_load"), (tt_metrics, "build_device_memory_monitor")]


@pytest.fixture
def one_rank(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def train(folder) -> list[dict]:
    config = parse_args(["--job.config_file", "debug_moe.toml", "--job.dump_folder", str(folder), "--training.steps",
                         "3", "--metrics.log_freq", "1", "--debug.seed", "0",
                         "--training.max_norm", "0.5"])  # clipping bites from the first step
    os.makedirs(folder, exist_ok=True)  # main creates and locks it before building the trainer
    trainer = FoldTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    return read_metrics(folder)


def test_second_trainer_sees_none_of_the_first(one_rank, tmp_path):
    before = [getattr(owner, name) for owner, name in WATCHED]
    first = train(tmp_path / "first")
    assert [getattr(owner, name) for owner, name in WATCHED] == before  # torchtitan as it was
    second = train(tmp_path / "second")
    assert len(first) == len(second) == 3
    for a, b in zip(first, second):
        # clipping applied with the second trainer's own optimizers, on its own parameters
        assert (b["loss"], b["grad_norm"]) == (a["loss"], a["grad_norm"]), a["step"]
    assert [getattr(owner, name) for owner, name in WATCHED] == before
