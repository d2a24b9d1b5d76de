"""Every key of torchtitan 0.2.2's JobConfig, classified: read (by titan_fold or by a torchtitan
component titan_fold uses), refused at any value but its default (one `error:` line naming what
to use instead), or of no effect (with the reason). tests/test_torchtitan_keys.py fails when
torchtitan's JobConfig has a key this table does not name; docs/configuration.md prints it
(`python -m titan_fold.common.torchtitan_keys`)."""

from typing import Any, NamedTuple

# where each read key is read -> the keys (a library's path is relative to site-packages); a key is
# listed with a file seen reading it (tests/test_torchtitan_keys.py traces a run's reads)
READ: dict[str, tuple[str, ...]] = {
    "torchtitan/config/manager.py": (
        "job.config_file",
        "job.custom_config_module",
        "experimental.custom_args_module",
        "model.tokenizer_path",
    ),
    "torchtitan/tools/profiling.py": (
        "profiling.enable_profiling",
        "profiling.save_traces_folder",
        "profiling.profile_freq",
        "profiling.profiler_active",
        "profiling.profiler_warmup",
        "profiling.enable_memory_snapshot",
        "profiling.save_memory_snapshot_folder",
    ),
    "torchtitan/components/metrics.py": ("metrics.log_freq",),
    "titan_fold/trainer/metrics.py": (
        "metrics.enable_tensorboard",
        "metrics.disable_color_printing",
        "metrics.save_tb_folder",
    ),
    "titan_fold/trainer/train_spec.py": ("compile.components",),
    "titan_fold/data/tokenizer.py": ("model.hf_assets_path",),
    "torchtitan/protocols/model_converter.py": (
        "model.converters",
        "model.print_after_conversion",
    ),
    "torchtitan/components/optimizer.py": (
        "optimizer.name",
        "optimizer.lr",
        "optimizer.beta1",
        "optimizer.beta2",
        "optimizer.eps",
        "optimizer.weight_decay",
        "optimizer.implementation",
        "optimizer.early_step_in_backward",
    ),
    "torchtitan/components/lr_scheduler.py": (
        "lr_scheduler.warmup_steps",
        "lr_scheduler.total_steps",
        "lr_scheduler.decay_ratio",
        "lr_scheduler.decay_type",
        "lr_scheduler.min_lr_factor",
    ),
    "titan_fold/data/dataloader.py": (
        "training.dataset",
        "training.dataset_path",
        "training.local_batch_size",
        "training.seq_len",
        "training.dataloader.num_workers",
        "training.dataloader.persistent_workers",
        "training.dataloader.pin_memory",
        "training.dataloader.prefetch_factor",
    ),
    "titan_fold/trainer/preflight.py": (
        "model.name",
        "model.flavor",
        "training.global_batch_size",
        "parallelism.data_parallel_replicate_degree",
        "parallelism.data_parallel_shard_degree",
        "parallelism.tensor_parallel_degree",
        "parallelism.pipeline_parallel_degree",
        "parallelism.context_parallel_degree",
        "parallelism.expert_parallel_degree",
        "parallelism.expert_tensor_parallel_degree",
    ),
    "titan_fold/trainer/fold_trainer.py": (
        "training.steps",
        "job.description",
        "checkpoint.create_seed_checkpoint",
        "comm.train_timeout_seconds",
        "experimental.custom_import",
        "training.gc_debug",
        "checkpoint.load_step",
        "comm.mode",
        "job.dump_folder",
        "training.dtype",
        "training.mixed_precision_param",
        "training.gc_freq",
    ),
    "titan_fold/trainer/step.py": ("training.max_norm",),
    "titan_fold/parallel/parallelize.py": (
        "parallelism.fsdp_reshard_after_forward",
        "parallelism.disable_loss_parallel",
        "activation_checkpoint.mode",
        "compile.enable",
        "compile.backend",
    ),
    "titan_fold/parallel/pipeline.py": (
        "parallelism.module_fqns_per_model_part",
        "parallelism.pipeline_parallel_first_stage_less_layers",
        "parallelism.pipeline_parallel_last_stage_less_layers",
        "parallelism.pipeline_parallel_layers_per_stage",
        "parallelism.pipeline_parallel_schedule",
        "parallelism.pipeline_parallel_schedule_csv",
        "parallelism.pipeline_parallel_microbatch_size",
    ),
    "torchtitan/components/checkpoint.py": (
        "checkpoint.enable",
        "checkpoint.enable_ft_dataloader_checkpoints",
        "checkpoint.folder",
        "checkpoint.interval",
        "checkpoint.initial_load_path",
        "checkpoint.initial_load_model_only",
        "checkpoint.initial_load_in_hf",
        "checkpoint.initial_load_in_hf_quantized",
        "checkpoint.last_save_model_only",
        "checkpoint.last_save_in_hf",
        "checkpoint.export_dtype",
        "checkpoint.async_mode",
        "checkpoint.keep_latest_k",
        "checkpoint.exclude_from_loading",
        "checkpoint.enable_first_step_checkpoint",
        "checkpoint.load_only",
    ),
    "torchtitan/distributed/activation_checkpoint.py": (
        "activation_checkpoint.selective_ac_option",
        "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
        "activation_checkpoint.early_stop",
        "activation_checkpoint.memory_budget",
        "activation_checkpoint.visualize_memory_budget_pareto",
        "activation_checkpoint.preserve_rng_state",
        "activation_checkpoint.determinism_check",
        "activation_checkpoint.debug",
    ),
    "torchtitan/components/quantization/float8.py": (
        "quantize.linear.float8.enable_fsdp_float8_all_gather",
        "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
        "quantize.linear.float8.recipe_name",
        "quantize.linear.float8.filter_fqns",
        "quantize.linear.float8.emulate",
    ),
    "torchtitan/components/quantization/mx.py": (
        "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
        "quantize.linear.mx.recipe_name",
        "quantize.linear.mx.filter_fqns",
    ),
    "torchtitan/distributed/utils.py": (
        "debug.seed",
        "debug.deterministic",
        "debug.deterministic_warn_only",
    ),
    "titan_fold/trainer/world.py": (
        "comm.init_timeout_seconds",
        "comm.trace_buf_size",
        "comm.save_traces_folder",
        "comm.save_traces_file_prefix",
    ),
    "titan_fold/compat/titan.py": (
        "metrics.enable_wandb",
        "metrics.save_for_all_ranks",
    ),
}


class Refused(NamedTuple):
    """A key whose component titan_fold replaces: any other value than `default` is one
    `error:` line naming `instead`."""

    key: str
    default: Any
    instead: str


EXPERT_FP8 = "torchtitan's grouped-GEMM converters are a second FP8 route for the experts; moe.expert_kernels = 'fp8' is titan_fold's"

REFUSED = (
    Refused(
        "parallelism.expert_parallel_comm_backend",
        "standard",
        "titan_fold's dispatcher exchanges the tokens (moe.exchange chooses how)",
    ),
    Refused("parallelism.enable_async_tensor_parallel", False, "titan_fold's tensor parallelism has no async variant"),
    Refused(
        "parallelism.context_parallel_rotate_method",
        "allgather",
        "titan_fold's context parallelism all-gathers K and V (docs/parallelize.md)",
    ),
    Refused(
        "parallelism.context_parallel_load_balancer",
        "headtail",
        "titan_fold's context parallelism splits each sequence head-tail (docs/parallelize.md)",
    ),
    Refused(
        "training.enable_cpu_offload",
        False,
        "titan_fold's FSDP keeps parameters and optimizer states on the device",
    ),
    Refused(
        "fault_tolerance.enable",
        False,
        "titan_fold builds no fault-tolerance manager (torchft); a stopped run resumes from its last checkpoint",
    ),
    Refused("quantize.grouped_mm.float8.fqns", [], EXPERT_FP8),
    Refused("quantize.grouped_mm.mx.fqns", [], EXPERT_FP8),
    Refused("validation.enable", False, "titan_fold builds no validator; training loss only"),
    Refused(
        "memory_estimation.enable",
        False,
        "python -m titan_fold.dryrun estimates each rank's memory before launch",
    ),
    Refused("job.print_config", False, "torchtitan 0.2.2 declares it and reads it nowhere"),
    Refused("job.save_config_file", None, "torchtitan 0.2.2 declares it and reads it nowhere"),
    Refused(
        "debug.moe_force_load_balance",
        False,
        "titan_fold's router has no forced balance; moe.load_balance chooses the balancing",
    ),
)

# key -> why it changes nothing
NO_EFFECT: dict[str, str] = {
    "training.mixed_precision_reduce": "its one value, 'float32', is the dtype titan_fold's FSDP reduces in",
    "parallelism.pipeline_parallel_expert_parallel_overlap": (
        "read by torchtitan's DualPipeV pipelining, which titan_fold's pipeline (parallel/pipeline.py) "
        "replaces; moe.ep_overlap chooses titan_fold's overlap"
    ),
    "memory_estimation.disable_fake_mode": "read only with memory_estimation.enable, which is refused",
    **{
        f"fault_tolerance.{key}": "read only with fault_tolerance.enable, which is refused"
        for key in (
            "process_group",
            "process_group_timeout_ms",
            "replica_id",
            "group_size",
            "min_replica_size",
            "semi_sync_method",
        )
    },
    "quantize.grouped_mm.mx.recipe_name": "read only by the quantize.grouped_mm.mx converter, which is refused",
    "validation.dataset": "read only with validation.enable, which is refused",
    "validation.dataset_path": "read only with validation.enable, which is refused",
    "validation.local_batch_size": "read only with validation.enable, which is refused",
    "validation.seq_len": "read only with validation.enable, which is refused",
    "validation.freq": "read only with validation.enable, which is refused",
    "validation.steps": "read only with validation.enable, which is refused",
    "validation.dataloader.num_workers": "read only with validation.enable, which is refused",
    "validation.dataloader.persistent_workers": "read only with validation.enable, which is refused",
    "validation.dataloader.pin_memory": "read only with validation.enable, which is refused",
    "validation.dataloader.prefetch_factor": "read only with validation.enable, which is refused",
}


def read_where() -> dict[str, str]:
    """key -> the file that reads it (titan_fold/...: in this repository; else in site-packages)."""
    return {key: where for where, keys in READ.items() for key in keys}


# model.converters' entries refused (the others are read) -> what to use instead
REFUSED_CONVERTERS: dict[str, str] = {
    "quantize.grouped_mm.float8": EXPERT_FP8,
    "quantize.grouped_mm.mx": EXPERT_FP8,
}


def refusal(config) -> str | None:
    """The line for the first refused key set to another value than its default, or for a
    refused model.converters entry; None when there is none."""
    for converter in config.model.converters:
        if converter in REFUSED_CONVERTERS:
            return (
                f"model.converters = {config.model.converters!r}: {converter!r} is not used by titan_fold "
                f"({REFUSED_CONVERTERS[converter]}); leave it out"
            )
    for key, default, instead in REFUSED:
        value = config
        for part in key.split("."):
            value = getattr(value, part)
        if value != default:
            return f"{key} = {value!r}: not used by titan_fold ({instead}); leave it at {default!r}"
    return None


def table() -> str:
    """The classification as a text table, one key a line."""
    rows = [(key, f"read: {where}") for key, where in read_where().items()]
    rows += [(r.key, f"refused unless {r.default!r}: {r.instead}") for r in REFUSED]
    rows += [(key, f"no effect: {why}") for key, why in NO_EFFECT.items()]
    rows = [
        (key, what + (f"; refused entries: {', '.join(REFUSED_CONVERTERS)}" if key == "model.converters" else ""))
        for key, what in rows
    ]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {what}" for key, what in sorted(rows))


if __name__ == "__main__":
    print(table())
