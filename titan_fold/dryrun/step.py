"""The trainer of a simulated rank: FoldTrainer built as a real run builds it, minus what one step does not use."""

import copy
import dataclasses
import functools
import os
import types

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module
from torchtitan.protocols import train_spec as train_spec_module
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import NoColor

from titan_fold.common.tensors import local
from titan_fold.dryrun.fake_counts import use_fake_counts
from titan_fold.parallel.mesh import Layout
from titan_fold.trainer.fold_trainer import FoldTrainer
from titan_fold.trainer.guard import NonFiniteError, NonFiniteGuard, SkippedStep, StashOverflow
from titan_fold.trainer.torchtitan_adapter import Names
from titan_fold.trainer.train_spec import register_train_specs


class VerdictFreeGuard(NonFiniteGuard):
    """The guard's all-reduce is one of the step's collectives, but under a fake process
    group no reduced value is a real number (with torch 2.11 the gradient norm comes out
    NaN or Inf): its verdict is ignored."""

    def before_optimizer_step(self, *hook_args) -> None:
        try:
            super().before_optimizer_step(*hook_args)
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

    def log(self, *args, **kwargs) -> None:
        pass


class NoGarbageCollection:
    """The process's garbage collection left as it is (torchtitan's turns it off)."""

    def __init__(self, *args, **kwargs):
        pass

    def run(self, step_count: int) -> None:
        pass


@functools.cache
def init_by_shard(model_cls: type[nn.Module]) -> type[nn.Module]:
    """model_cls whose init_weights runs on each parameter's local shard: each shard gets the
    init's own distribution without a DTensor dispatch per op (the CPU time of a step's
    recording). For models whose values cannot change a collective: dropless routing (the
    fake dispatcher splits rows evenly whatever the router says) and untied embeddings
    (init_weights ties them again)."""

    def init_weights(self, *args, **kwargs):
        shards = {name: local(p) for name, p in self.named_parameters()}
        with _reparametrize_module(self, shards):
            super(by_shard, self).init_weights(*args, **kwargs)

    by_shard = type(model_cls.__name__, (model_cls,), {"init_weights": init_weights})
    return by_shard


class StepTrainer(FoldTrainer):
    """FoldTrainer on a simulated rank of the fake world: its own __init__ (torchtitan's
    Trainer.__init__ included) builds the model, optimizers, lr schedulers, guard, hooks and
    train context as in a real run; no tokenizer, dataloader, checkpoint manager or metrics
    files are built (torchtitan's names for them resolve to nothing here), the model args are
    the given (shrunk) ones, and under PP the real run's schedule issues the send/recv."""

    guard_class = VerdictFreeGuard

    def __init__(self, config, layout: Layout, model_args):
        register_train_specs()
        self._layout = layout
        spec = train_spec_module.get_train_spec(config.model.name)
        by_shard = config.moe.capacity_factor is None and not model_args.tie_embeddings
        # the args are final: the `hf` flavor's update_from_config would read its config.json again
        model_args = copy.copy(model_args)
        model_args.update_from_config = lambda *args, **kwargs: None
        self._spec = dataclasses.replace(
            spec,
            model_args={config.model.flavor: model_args},
            model_cls=init_by_shard(spec.model_cls) if by_shard else spec.model_cls,
            build_tokenizer_fn=None,
            build_dataloader_fn=None,
            build_metrics_processor_fn=NoRecords,
            state_dict_adapter=None,
        )
        super().__init__(config)
        use_fake_counts(self.model_parts)
        self.step = 1  # Trainer.train counts the step before it runs it

    def init_distributed(self) -> Layout:
        return self._layout

    def torchtitan_names(self) -> dict:
        names = super().torchtitan_names()
        return {
            **names,
            "os": Names(os, environ={"LOCAL_RANK": "0"}),
            "utils": Names(
                names["utils"],
                device_type="cpu",
                device_module=torch.cpu,
                GarbageCollection=NoGarbageCollection,
                get_peak_flops=lambda device_name: 0.0,
            ),
            # values do not change a dry run's collectives: no seeding (and its warnings per rank)
            "dist_utils": Names(names["dist_utils"], set_determinism=lambda *args, **kwargs: None),
            "train_spec_module": Names(train_spec_module, get_train_spec=lambda name: self._spec),
            "CheckpointManager": NoRecords,
            "ensure_pp_loss_visible": lambda *args, **kwargs: None,
            # a simulated rank says nothing: the dry run's report speaks for it
            "logger": Names(logger, info=lambda *args, **kwargs: None, warning=lambda *args, **kwargs: None),
        }
