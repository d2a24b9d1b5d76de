"""`torchrun --nproc_per_node N -m titan_fold.train --job.config_file FILE.toml [--section.key value ...]`

FoldTrainer is torchtitan 0.2.2's Trainer with the folded layout as its parallel dims,
MoE aux losses normalized like the LM loss, and the aux-free router bias updated after
each optimizer step. Everything that can be checked without a process group (config
values, degrees against the world size and the model, tokenizer against the vocabulary)
is checked in `preflight` before the first collective.
"""

import os

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer

from titan_fold.checkpoint import check_initial_hf_load, maybe_fault
from titan_fold.config import ConfigError, JobConfig, parse_args
from titan_fold.errors import run_command
from titan_fold.moe import moe_layers, update_expert_bias
from titan_fold.parallel.attention import cp_shard
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.pipeline import check_pipeline, pipeline_forward_backward
from titan_fold.torchtitan_adapter import init_distributed, trainer_names, with_names
from titan_fold.train_spec import register_train_specs


def layout_from_config(config: JobConfig, world_size: int) -> Layout:
    p = config.parallelism
    return Layout(
        world_size=world_size,
        pp=p.pipeline_parallel_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
        edp=p.expert_data_parallel_degree,
    )


def model_args_from_config(config: JobConfig):
    register_train_specs()
    name, flavor = config.model.name, config.model.flavor
    try:
        spec = get_train_spec(name)
    except ValueError:
        raise ConfigError(f"model.name = {name!r}: not a titan_fold model family") from None
    if flavor not in spec.model_args:
        raise ConfigError(f"model.flavor = {flavor!r}: {name} has {sorted(spec.model_args)}")
    model_args = spec.model_args[flavor]
    model_args.update_from_config(config)
    return spec, model_args


def preflight(config: JobConfig, world_size: int) -> Layout:
    """Reject bad input before any process group, file or model exists."""
    layout = check_layout(config, world_size)
    spec, model_args = model_args_from_config(config)
    tokenizer = spec.build_tokenizer_fn(config)
    if tokenizer.get_vocab_size() > model_args.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens but model {config.model.name} "
            f"{config.model.flavor} has vocab_size {model_args.vocab_size}"
        )
    check_initial_hf_load(config, model_args)
    return layout


def check_layout(config: JobConfig, world_size: int) -> Layout:
    """The config's degrees, pipeline and MoE settings against the model and the world size."""
    _, model_args = model_args_from_config(config)
    moe = model_args.moe
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"moe.top_k = {moe.top_k}: larger than the model's {moe.num_experts} experts")
    layout = layout_from_config(config, world_size)
    layout.validate_model(model_args, config.training.seq_len)
    if layout.pp > 1:
        check_pipeline(config, model_args, layout.pp)
    return layout


class FoldTrainer(Trainer):
    """torchtitan's Trainer; its __init__, train_step and train run as torchtitan wrote them,
    with the names torchtitan_adapter.py lists resolved to titan_fold's (device, mixed
    precision, clipping, checkpoint manager, timeouts)."""

    def init_distributed(self) -> Layout:
        world_size = init_distributed(self.job_config.comm, base_folder=self.job_config.job.dump_folder)
        layout = layout_from_config(self.job_config, world_size)
        layout.build_mesh()
        return layout

    def _torchtitan(self, method):
        return with_names(method, **self._names).__get__(self)

    def __init__(self, job_config: JobConfig):
        register_train_specs()
        self._names = trainer_names(self)
        self._torchtitan(Trainer.__init__)(job_config)
        if self.model_args.moe.load_balance == "aux_free":
            # the expert load of every token this stage routed
            stage_mesh = self.parallel_dims.get_optional_mesh("stage")
            group = stage_mesh.get_group() if stage_mesh is not None else None

            def all_reduce(t: torch.Tensor) -> torch.Tensor:
                if group is not None:
                    torch.distributed.all_reduce(t, group=group)
                return t

            self.optimizers.register_step_post_hook(
                lambda *args, **kwargs: update_expert_bias(self.model_parts, all_reduce)
            )

    def post_dataloading_process(self, input_dict, labels):
        # torchtitan's version would apply torch's context_parallel; ours shards the batch
        inputs = input_dict["input"]
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        extra_kwargs = {}
        layout = self.parallel_dims
        if layout.cp > 1:
            # load-balanced causal split; the model needs the global positions for RoPE
            inputs, labels, extra_kwargs["positions"] = cp_shard(inputs, labels, layout.attention["cp"])
        return inputs, labels, extra_inputs, extra_kwargs

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self.parallel_dims.pp_enabled:
            loss = pipeline_forward_backward(
                self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        else:
            # aux losses are token means over this micro-batch's sequences (the router gathers
            # their statistics over cp x tp); weigh them like the LM loss, whose sum is divided
            # by the global token count. `labels` is still the whole micro-batch here.
            scale = (labels != IGNORE_INDEX).sum() / global_valid_tokens
            for moe in moe_layers(self.model_parts):
                moe.aux_loss_scale.fill_(scale)
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        maybe_fault(self.step)  # tests: a rank killed in the middle of a step
        return loss

    def train_step(self, data_iterator):
        return self._torchtitan(Trainer.train_step)(data_iterator)

    @record
    def train(self):
        return self._torchtitan(Trainer.train)()


@record
def main(args: list[str] | None = None) -> None:
    init_logger()
    config = parse_args(args)
    preflight(config, int(os.environ.get("WORLD_SIZE", "1")))
    trainer = None
    try:
        trainer = FoldTrainer(config)
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise ConfigError("checkpoint.create_seed_checkpoint: run it on a single rank (it must not be sharded)")
            if not config.checkpoint.enable:
                raise ConfigError("checkpoint.create_seed_checkpoint needs checkpoint.enable = true")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_command(main)
