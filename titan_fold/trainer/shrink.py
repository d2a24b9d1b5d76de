"""`--debug.shrink`: any job config as a run of a few steps on the ranks at hand (CPU ranks).

    python -m titan_fold.run --nproc_per_node 2 --job.config_file qwen3_30b_a3b.toml --debug.shrink

The config keeps its keys (optimizer, router, data format, schedule) and changes what makes it
big (SMALL): the model becomes its family's debug flavor (4 layers, 8 experts) with the
byte-level tokenizer, the sequence, batch and step count those of the debug configs, with one
micro-batch per step (global batch = local x dp), fp32, no compile, no activation recompute and
no checkpoint; the run writes to `<dump_folder>_shrunk`, not into the full run's folder.

The folding keeps its shape where it fits: each degree in ORDER, the folding's own first
(the attention's cp and tp, the experts' ep and etp), takes the largest value up to its own
that passes the run's layout check on these ranks with the degrees before it; dp_shard and
edp are derived. What changed is said in a line per section.
"""

import os
from typing import Any

from titan_fold.common.config import JobConfig
from titan_fold.common.errors import UserError
from titan_fold.parallel.mesh import divisors
from titan_fold.trainer.preflight import check_layout

STEPS = 4
LOCAL_BATCH = 2  # sequences per rank and micro-batch (pipeline: per stage and micro-batch)
SEQ_LEN = {"text": 128, "chat": 256, "rollouts": 256}  # a packed sample holds whole records
# the degrees in the order they are kept, each as large as fits with the ones before it
ORDER = (
    "context_parallel_degree",
    "tensor_parallel_degree",
    "expert_parallel_degree",
    "expert_tensor_parallel_degree",
    "pipeline_parallel_degree",
    "data_parallel_replicate_degree",
)


def small(config: JobConfig) -> dict[str, Any]:
    """The small run's values ("section.key" -> value), but for the degrees."""
    default = JobConfig()
    return {
        "model.flavor": "debug",
        "model.hf_config": default.model.hf_config,
        "model.hf_assets_path": "",  # the byte-level tokenizer: the configs' folders are on the cluster
        "model.max_seq_len": default.model.max_seq_len,
        "training.seq_len": SEQ_LEN[config.training.dataset_format],
        "training.steps": min(config.training.steps, STEPS),
        "training.global_batch_size": -1,  # local x dp: one micro-batch per step
        "training.dtype": "float32",  # bf16 on a CPU is ~10x slower
        "training.mixed_precision_param": "float32",
        "compile.enable": False,
        "activation_checkpoint.mode": "none",
        "checkpoint.enable": False,
        # the full model's weights do not fit the debug flavor
        "checkpoint.initial_load_path": default.checkpoint.initial_load_path,
        "checkpoint.initial_load_in_hf": default.checkpoint.initial_load_in_hf,
        "job.dump_folder": config.job.dump_folder.rstrip("/") + "_shrunk",
    }


def _set(config: JobConfig, key: str, value: Any) -> None:
    section, name = key.split(".")
    setattr(getattr(config, section), name, value)


def _get(config: JobConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _fits(config: JobConfig, world_size: int) -> bool:
    try:
        check_layout(config, world_size)
    except UserError:
        return False
    return True


def fit_degrees(config: JobConfig, world_size: int) -> None:
    """Each degree of ORDER the largest up to its own that fits world_size ranks with the ones
    before it (the others at 1); dp_shard and edp derived; the local batch a multiple of the
    pipeline's micro-batches."""
    par, tr = config.parallelism, config.training
    wanted = {key: getattr(par, key) for key in ORDER}
    for key in ORDER:
        setattr(par, key, 1)
    par.data_parallel_shard_degree = par.expert_data_parallel_degree = -1
    for key in ORDER:
        for degree in sorted((d for d in divisors(world_size) if d <= wanted[key]), reverse=True):
            setattr(par, key, degree)
            # two pipeline micro-batches per stage: a steady state in every schedule
            tr.local_batch_size = LOCAL_BATCH * par.pipeline_parallel_degree * par.pipeline_parallel_microbatch_size
            if _fits(config, world_size):
                break
        else:
            setattr(par, key, 1)
    tr.local_batch_size = LOCAL_BATCH * par.pipeline_parallel_degree * par.pipeline_parallel_microbatch_size


def shrink(config: JobConfig, world_size: int) -> list[str]:
    """Shrink config in place onto world_size ranks (see the module's docstring); -> what
    changed, a line per section: "  section: key old -> new, ..."."""
    values = small(config)
    keys = [*values, "training.local_batch_size", *(f"parallelism.{k}" for k in ORDER)]
    keys += ["parallelism.data_parallel_shard_degree", "parallelism.expert_data_parallel_degree"]
    before = {key: _get(config, key) for key in keys}
    for key, value in values.items():
        _set(config, key, value)
    fit_degrees(config, world_size)
    lines: dict[str, list[str]] = {}
    for key in keys:
        if (now := _get(config, key)) != before[key]:
            section, name = key.split(".")
            lines.setdefault(section, []).append(f"{name} {before[key]!r} -> {now!r}")
    steps = config.training.steps
    name = os.path.basename(config.job.config_file) or "the config"
    header = f"--debug.shrink: {name} as a run of {steps} steps on {world_size} ranks"
    return [header, *(f"  {section}: {', '.join(changes)}" for section, changes in lines.items())]
