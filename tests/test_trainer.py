"""FoldTrainer builds and runs a run from torchtitan's components without changing torchtitan's
modules, so two trainers built one after the other in one process (as tests and notebooks do)
each run as if alone: the second reproduces the first's losses and gradient norms step for
step. Its own train step logs what torchtitan's does, and on a GPU waits for the device nowhere."""

import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torchtitan.components.checkpoint as tt_checkpoint
import torchtitan.components.metrics as tt_metrics
import torchtitan.distributed.utils as tt_dist_utils
import torchtitan.tools.utils as tt_utils
from helpers import read_metrics
from torchtitan.train import Trainer

from titan_fold.common.config import parse_args
from titan_fold.trainer.fold_trainer import FoldTrainer

# the module attributes titan_fold once assigned, each to change what torchtitan's code did
WATCHED = [
    (tt_utils, "device_type"),
    (tt_utils, "device_module"),
    (tt_dist_utils, "device_type"),
    (tt_dist_utils, "clip_grad_norm_"),
    (tt_dist_utils, "maybe_enable_amp"),
    (tt_dist_utils, "set_pg_timeouts"),
    (tt_checkpoint.CheckpointManager, "dcp_load"),
    (tt_metrics, "build_device_memory_monitor"),
]


@pytest.fixture
def one_rank(monkeypatch):
    gc_enabled = gc.isenabled()  # torchtitan's trainer turns automatic collection off for its process
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    # the trainer's process group sits in reference cycles: collected now, its store's event-loop
    # thread is joined in this process, not left to a later collection
    gc.collect()
    if gc_enabled:
        gc.enable()


def train(folder, trainer_class=FoldTrainer, steps: int = 3, each_step=None, args: tuple[str, ...] = ()) -> list[dict]:
    """`steps` steps of debug_moe.toml (two micro-batches a step) on this process's device;
    each_step(trainer, step) wraps each step's call where given."""
    config = parse_args(
        [
            "--job.config_file",
            "debug_moe.toml",
            "--job.dump_folder",
            str(folder),
            "--training.steps",
            str(steps),
            "--metrics.log_freq",
            "1",
            "--debug.seed",
            "0",
            "--training.max_norm",
            "0.5",
            *args,
        ]
    )  # clipping bites from the first step
    os.makedirs(folder, exist_ok=True)  # main creates and locks it before building the trainer
    trainer = trainer_class(config)
    if each_step is not None:
        step = trainer.train_step
        trainer.train_step = lambda data_iterator: each_step(trainer, lambda: step(data_iterator))
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
    for a, b in zip(first, second, strict=True):
        # clipping applied with the second trainer's own optimizers, on its own parameters
        assert (b["loss"], b["grad_norm"]) == (a["loss"], a["grad_norm"]), a["step"]
    assert [getattr(owner, name) for owner, name in WATCHED] == before


class TorchtitanStep(FoldTrainer):
    """FoldTrainer running torchtitan 0.2.2's own Trainer.train_step on itself (it reads only
    attributes FoldTrainer has, and calls its forward_backward_step). That step reads the loss
    and the gradient norm on the device, with no wait for host copies: none is made for it."""

    def _train_step(self, data_iterator):
        Trainer.train_step(self, data_iterator)

    def _logs(self):
        return False


def test_train_step_logs_what_torchtitans_does(one_rank, tmp_path, monkeypatch):
    """FoldTrainer's step, which waits for the device nowhere, against torchtitan's: the same
    losses, gradient norms and token counts, step for step, with two micro-batches a step.
    torchtitan's step clips with FoldTrainer's clipping for this comparison (the one name it
    calls that is not a method), so that both apply the same clip coefficient the same way."""
    ours = train(tmp_path / "ours")
    trainers = []
    monkeypatch.setattr(
        tt_dist_utils, "clip_grad_norm_", lambda *args, **kwargs: trainers[0].clip_grad_norm(*args, **kwargs)
    )
    theirs = train(tmp_path / "theirs", lambda config: trainers.append(TorchtitanStep(config)) or trainers[0])
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs, strict=True):
        keys = ("loss", "max_loss", "grad_norm", "lr", "n_tokens_seen")
        assert [a[k] for k in keys] == [b[k] for k in keys], a["step"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_train_step_waits_for_the_device_nowhere(one_rank, tmp_path):
    """On a GPU the steps after the first two (kernels loaded, memory cached) run no op that waits
    for the device (torch's sync debug mode raises at any): the host queues a step while the device
    still runs the one before. The guard's wait for the step's host copies, an event's, is the one
    wait of a step (host_copies.py). In bf16, as GPU runs train: fp32 experts take the per-expert
    loop, which reads the row counts on the host."""

    def checked(trainer, step):
        torch.cuda.set_sync_debug_mode("error" if trainer.step > 2 else "default")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    bf16 = ("--training.mixed_precision_param", "bfloat16", "--training.dtype", "bfloat16")
    assert len(train(tmp_path, steps=4, each_step=checked, args=bf16)) == 4
