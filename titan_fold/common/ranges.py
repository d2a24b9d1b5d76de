"""Every numeric job config key's valid values (config.check_ranges applies them before any
process starts; docs/configuration.md lists them)."""

import typing


class Range(typing.NamedTuple):
    """A numeric key's valid values: `rule` is what the error line and docs/configuration.md say,
    `ok` the test. An unset (None) optional key is not checked."""

    key: str
    rule: str
    ok: typing.Callable[[typing.Any], bool]  # the key's value: a number, or a string or list for a few


def _at_least(low: float) -> typing.Callable[[float], bool]:
    return lambda v: v >= low


def _unit(v: float) -> bool:
    return 0 <= v <= 1


def _derived_or_positive(v: int) -> bool:
    return v == -1 or v >= 1


# every numeric key titan_fold or torchtitan reads, with its range (debug.seed: any integer);
# tests/test_config.py checks that the list is complete and that docs/configuration.md lists it
RANGES = (
    Range("optimizer.lr", ">= 0", _at_least(0)),
    Range("optimizer.beta1", "in [0, 1)", lambda v: 0 <= v < 1),
    Range("optimizer.beta2", "in [0, 1)", lambda v: 0 <= v < 1),
    Range("optimizer.eps", ">= 0", _at_least(0)),
    Range("optimizer.weight_decay", ">= 0", _at_least(0)),
    Range("optimizer.muon_momentum", "in [0, 1)", lambda v: 0 <= v < 1),
    Range("optimizer.muon_ns_steps", "in [1, 99]", lambda v: 1 <= v <= 99),
    Range("optimizer.muon_ns_coefficients", "three numbers (a, b, c)", lambda v: len(v) == 3),
    Range("lr_scheduler.warmup_steps", ">= 0", _at_least(0)),
    Range("lr_scheduler.total_steps", ">= 1 (unset: training.steps)", _at_least(1)),
    Range("lr_scheduler.decay_ratio", "in [0, 1] (unset: decay after the warmup)", _unit),
    Range("lr_scheduler.min_lr_factor", "in [0, 1]", _unit),
    Range("training.local_batch_size", ">= 1", _at_least(1)),
    Range("training.global_batch_size", ">= 1, or -1 for local x dp", _derived_or_positive),
    Range("training.seq_len", ">= 1", _at_least(1)),
    Range("training.steps", ">= 0", _at_least(0)),
    Range("training.max_norm", "> 0 (inf: no clipping)", lambda v: v > 0),
    Range("training.gc_freq", ">= 1", _at_least(1)),
    Range("training.policy_clip_low", "in [0, 1)", lambda v: 0 <= v < 1),
    Range("training.policy_clip_high", ">= 0", _at_least(0)),
    Range("training.policy_tis_cap", ">= 1, or 0 for off", lambda v: v == 0 or v >= 1),
    Range("training.dataloader.num_workers", ">= 0", _at_least(0)),
    Range("training.dataloader.prefetch_factor", ">= 1", _at_least(1)),
    Range("model.max_seq_len", ">= 0 (0: the flavor's context length)", _at_least(0)),
    *(
        Range(f"parallelism.{key}", ">= 1", _at_least(1))
        for key in (
            "tensor_parallel_degree",
            "context_parallel_degree",
            "pipeline_parallel_degree",
            "data_parallel_replicate_degree",
            "expert_parallel_degree",
            "expert_tensor_parallel_degree",
        )
    ),
    *(
        Range(f"parallelism.{key}", ">= 1, or -1 to derive it", _derived_or_positive)
        for key in ("data_parallel_shard_degree", "expert_data_parallel_degree")
    ),
    Range("parallelism.pipeline_parallel_first_stage_less_layers", ">= 0", _at_least(0)),
    Range("parallelism.pipeline_parallel_last_stage_less_layers", ">= 0", _at_least(0)),
    Range("parallelism.pipeline_parallel_layers_per_stage", ">= 1", _at_least(1)),
    Range("parallelism.pipeline_parallel_microbatch_size", ">= 1", _at_least(1)),
    Range("checkpoint.interval", ">= 1", _at_least(1)),
    Range(
        "checkpoint.keep_latest_k",
        "0 (keep all) or >= 2 (one may be in the middle of its save)",
        lambda v: v == 0 or v >= 2,
    ),
    Range("checkpoint.load_step", ">= 0, or -1 for the latest", lambda v: v >= -1),
    Range("activation_checkpoint.memory_budget", "in [0, 1]", _unit),
    # torchtitan's: a number in a string (every n-th layer), or "op"
    Range(
        "activation_checkpoint.selective_ac_option",
        "'op' or an integer >= 1 (every n-th layer)",
        lambda v: v == "op" or (v.isdigit() and int(v) >= 1),
    ),
    Range("metrics.log_freq", ">= 1", _at_least(1)),
    Range("profiling.profile_freq", ">= 1", _at_least(1)),
    Range("profiling.profiler_active", ">= 1", _at_least(1)),
    Range("profiling.profiler_warmup", ">= 0", _at_least(0)),
    Range("comm.init_timeout_seconds", ">= 1", _at_least(1)),
    Range("comm.train_timeout_seconds", ">= 1", _at_least(1)),
    Range("comm.trace_buf_size", ">= 0", _at_least(0)),
    Range("comm.dry_run_rank", ">= 0, or -1 for every position", lambda v: v >= -1),
    Range("fault_tolerance.process_group_timeout_ms", ">= 1", _at_least(1)),
    Range("fault_tolerance.replica_id", ">= 0", _at_least(0)),
    Range("fault_tolerance.group_size", ">= 0", _at_least(0)),
    Range("fault_tolerance.min_replica_size", ">= 1", _at_least(1)),
    Range("validation.local_batch_size", ">= 1", _at_least(1)),
    Range("validation.seq_len", ">= 1", _at_least(1)),
    Range("validation.freq", ">= 1", _at_least(1)),
    Range("validation.steps", ">= 1, or -1 for the whole set", _derived_or_positive),
    Range("validation.dataloader.num_workers", ">= 0", _at_least(0)),
    Range("validation.dataloader.prefetch_factor", ">= 1", _at_least(1)),
    Range("moe.capacity_factor", "> 0 (unset it for dropless)", lambda v: v > 0),
    Range("moe.top_k", ">= 1", _at_least(1)),
    Range("moe.num_groups", ">= 1", _at_least(1)),
    Range("moe.group_topk", ">= 1", _at_least(1)),
    Range("moe.routed_scaling_factor", "> 0", lambda v: v > 0),
    Range("moe.aux_loss_coeff", ">= 0", _at_least(0)),
    Range("moe.z_loss_coeff", ">= 0", _at_least(0)),
    Range("moe.stash_rows", ">= 0", _at_least(0)),
    Range("moe.hot_expert_replicas", ">= 0", _at_least(0)),
    Range("mtp.num_layers", ">= 0", _at_least(0)),
    Range("mtp.loss_scaling_factor", ">= 0", _at_least(0)),
)
