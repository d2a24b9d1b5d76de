"""The trainer of a simulated rank: FoldTrainer built as a real run builds it, minus what one step does not use."""

import contextlib
import copy
import dataclasses
import functools
import logging
import types

import torch
import torch.nn as nn
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import NoColor

from titan_fold.common.tensors import local
from titan_fold.compat.dispatch import reparametrize_module
from titan_fold.dryrun.fake_counts import use_fake_counts
from titan_fold.parallel.mesh import Layout
from titan_fold.trainer.fold_trainer import FoldTrainer
from titan_fold.trainer.guard import NonFiniteError, NonFiniteGuard, SkippedStep, StashOverflow
from titan_fold.trainer.world import World


class VerdictFreeGuard(NonFiniteGuard):
    """The guard's all-reduce is one of the step's collectives, but under a fake process
    group no reduced value is a real number (with torch 2.11 the gradient norm comes out
    NaN or Inf): its verdict is ignored."""

    def before_optimizer_step(self) -> None:
        try:
            super().before_optimizer_step()
        except (NonFiniteError, SkippedStep, StashOverflow):
            pass


class NoRecords:
    """Checkpoint manager and metrics processor of a step that saves and logs nothing: every
    step counts as a logging step, so the loss reductions over dp x cp are issued."""

    color = NoColor()
    device_memory_monitor = types.SimpleNamespace(
        device_name="cpu", get_peak_stats=lambda: types.SimpleNamespace(max_reserved_gib=0.0, max_reserved_pct=0.0)
    )

    def __init__(self, *args, **kwargs):
        pass

    def maybe_wait_for_staging(self) -> None:
        pass

    def should_log(self, step: int) -> bool:
        return True

    def stage(self, copy) -> None:
        pass

    def log(self, *args, **kwargs) -> dict:
        return {}


@functools.cache
def init_by_shard(model_cls: type[nn.Module]) -> type[nn.Module]:
    """model_cls whose init_weights runs on each parameter's local shard: each shard gets the
    init's own distribution without a DTensor dispatch per op (the CPU time of a step's
    recording). For models whose values cannot change a collective: dropless routing (the
    fake dispatcher splits rows evenly whatever the router says) and untied embeddings
    (init_weights ties them again)."""

    def init_weights(self, *args, **kwargs):
        shards = {name: local(p) for name, p in self.named_parameters()}
        with reparametrize_module(self, shards):
            model_cls.init_weights(self, *args, **kwargs)

    return type(model_cls.__name__, (model_cls,), {"init_weights": init_weights})


class StepTrainer(FoldTrainer):
    """FoldTrainer on a simulated rank of the fake world, built by FoldTrainer's own __init__
    through its seams: the World of the given layout on the CPU; the train spec with the given
    (shrunk) model args and no tokenizer, dataloader, state-dict adapter or metrics files; no
    checkpoint manager, garbage-collection handler or seeding; the guard's verdict ignored; the
    MoE layers' counts made up (fake_counts.py). The model, optimizers, lr schedulers, the step's
    order and train context are a real run's; under PP the real run's schedule issues the send/recv."""

    guard_class = VerdictFreeGuard

    def __init__(self, config, layout: Layout, model_args):
        self._model_args = model_args
        with quiet():  # a simulated rank says nothing: the dry run's report speaks for it
            super().__init__(config, world=World(torch.device("cpu:0"), given_layout=layout))
        use_fake_counts(self.model_parts)
        self.step = 1  # the loop counts the step before it runs it

    def build_train_spec(self):
        spec = super().build_train_spec()
        flavor = self.job_config.model.flavor
        by_shard = self.job_config.moe.capacity_factor is None and not self._model_args.tie_embeddings
        # the args are final: the `hf` flavor's update_from_config would read its config.json again
        model_args = copy.copy(self._model_args)
        model_args.update_from_config = lambda *args, **kwargs: None
        return dataclasses.replace(
            spec,
            model_args={flavor: model_args},
            model_cls=init_by_shard(spec.model_cls) if by_shard else spec.model_cls,
            build_tokenizer_fn=None,
            build_dataloader_fn=None,
            build_metrics_processor_fn=NoRecords,
            state_dict_adapter=None,
        )

    def build_checkpointer(self):
        return NoRecords()

    def build_gc_handler(self):
        return None  # the process's garbage collection left as it is (torchtitan's turns it off)

    def seed(self) -> None:
        pass  # values do not change a dry run's collectives


@contextlib.contextmanager
def quiet():
    """torchtitan's logger (the root logger) says only errors."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
