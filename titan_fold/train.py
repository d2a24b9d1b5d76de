"""`torchrun --nproc_per_node N -m titan_fold.train --job.config_file FILE.toml [--section.key value ...]`

FoldTrainer is torchtitan 0.2.2's Trainer with the folded layout as its parallel dims,
MoE aux losses normalized like the LM loss, and the aux-free router bias updated after
each optimizer step. Everything that can be checked without a process group (config
values, degrees against the world size and the model, tokenizer against the vocabulary)
is checked in `preflight` before the first collective.
"""

import contextlib
import functools
import os

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import utils as dist_utils
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer

from titan_fold.checkpoint import install_checkpoint_hooks
from titan_fold.config import ConfigError, JobConfig, parse_args
from titan_fold.parallel.attention import cp_shard
from titan_fold.parallel.clip import clip_grad_norm_
from titan_fold.moe import MoE, update_expert_bias
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.pipeline import check_pipeline, pipeline_forward_backward
from titan_fold.train_spec import register_train_specs
from titan_fold.errors import run_command
from titan_fold.dryrun import banner, main as dry_run_main


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
    return spec, spec.model_args[flavor]


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
    return layout


def check_layout(config: JobConfig, world_size: int) -> Layout:
    """The config's degrees, pipeline and MoE settings against the model and the world size."""
    _, model_args = model_args_from_config(config)
    model_args.update_from_config(config)
    moe = model_args.moe
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"moe.top_k = {moe.top_k}: larger than the model's {moe.num_experts} experts")
    layout = layout_from_config(config, world_size)
    layout.validate(
        num_experts=moe.num_experts,
        moe_ffn_dim=moe.moe_ffn_dim,
        n_heads=model_args.n_heads,
        n_kv_heads=model_args.n_kv_heads,
        seq_len=config.training.seq_len,
    )
    if layout.pp > 1:
        check_pipeline(config, model_args, layout.pp)
    return layout


def maybe_enable_amp(parallel_dims, mixed_precision_param: str, device_type: str):
    """Compute in `training.mixed_precision_param` in every layout: FSDP2 casts where it wraps
    the model (any dp or cp), autocast everywhere else. torchtitan 0.2.2 computes tp or pp
    layouts without data parallelism in fp32, e.g. the folded tp 2 x ep 2 on 2 GPUs."""
    dtype = TORCH_DTYPE_MAP[mixed_precision_param]
    if parallel_dims.dp_cp_enabled or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


# torchtitan's Trainer clips and picks mixed precision through these module attributes.
# Our clipping also handles parameters spread over the attention and expert meshes (and is
# the same for one mesh).
dist_utils.clip_grad_norm_ = clip_grad_norm_
dist_utils.maybe_enable_amp = maybe_enable_amp


class FoldTrainer(Trainer):
    def init_distributed(self) -> Layout:
        world_size = dist_utils.init_distributed(self.job_config.comm, base_folder=self.job_config.job.dump_folder)
        layout = layout_from_config(self.job_config, world_size)
        layout.build_mesh()
        return layout

    def __init__(self, job_config: JobConfig):
        super().__init__(job_config)
        # RNG state in checkpoints, shape checks before any load, fault-injection hook for tests
        install_checkpoint_hooks(self)
        if torch.distributed.get_rank() == 0:
            pp = self.parallel_dims.pp
            stages = len(check_pipeline(job_config, self.model_args, pp)[1]) if pp > 1 else 1
            logger.info(banner(self.parallel_dims, self.model_args, self.model_parts, job_config, stages))
        # fused optimizers apply the clip coefficient as they read the gradients (parallel/clip.py)
        dist_utils.clip_grad_norm_ = functools.partial(clip_grad_norm_, optimizers=self.optimizers.optimizers)
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
            return pipeline_forward_backward(
                self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        # aux losses are token means over this micro-batch's sequences (the router gathers
        # their statistics over cp x tp); weigh them like the LM loss, whose sum is divided
        # by the global token count. `labels` is still the whole micro-batch here.
        scale = (labels != IGNORE_INDEX).sum() / global_valid_tokens
        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, MoE):
                    module.aux_loss_scale.fill_(scale)
        return super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )


@record
def main(args: list[str] | None = None) -> None:
    init_logger()
    config = parse_args(args)
    if config.comm.mode != "default":
        # torchtitan's dry run (NGPU fake ranks in one process): titan_fold's own, see dryrun.py
        return dry_run_main(config)
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
