"""Everything a run checks before any process group, file or model exists: degrees, model, batch, paths."""

import dataclasses
import os
import re
from typing import Any

import torch
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec
from torchtitan.tools.logging import logger

from titan_fold.checkpoint.files import check_initial_hf_load
from titan_fold.checkpoint.settings import check_resume, check_resume_step, run_settings
from titan_fold.common.config import ConfigError, JobConfig
from titan_fold.common.errors import is_first_rank
from titan_fold.common.storage import StorageError, folder_problem
from titan_fold.common.values import no_config_file
from titan_fold.data.dataloader import check_dataset
from titan_fold.models import FLAVORS
from titan_fold.models.args import TransformerArgs
from titan_fold.moe.fp8 import fp8_problem
from titan_fold.moe.quack import quack_problem, varying_rows
from titan_fold.parallel.attention import LINEAR_ATTENTION_CP
from titan_fold.parallel.mesh import Layout, LayoutError, model_sizes
from titan_fold.parallel.overlap import overlap_problem
from titan_fold.parallel.pipeline import check_pipeline
from titan_fold.trainer.train_spec import register_train_specs


def layout_from_config(config: JobConfig, world_size: int, model: dict | None = None) -> Layout:
    """model: the sizes the layout is then validated against (Layout's `model`)."""
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
        model=model,
    )


def model_args_from_config(config: JobConfig) -> tuple[TrainSpec, TransformerArgs]:
    register_train_specs()
    name, flavor = config.model.name, config.model.flavor
    if name not in FLAVORS and not config.job.config_file:  # torchtitan's default model.name
        raise ConfigError(no_config_file())
    if name not in FLAVORS:  # torchtitan's own families (llama3, ...) are registered too
        raise ConfigError(f"model.name = {name!r}: not a titan_fold model family (families: {sorted(FLAVORS)})")
    spec = get_train_spec(name)
    if flavor not in spec.model_args:
        raise ConfigError(f"model.flavor = {flavor!r}: {name} has {sorted(spec.model_args)}")
    model_args = spec.model_args[flavor]
    model_args.update_from_config(config)
    return spec, model_args


@dataclasses.dataclass
class Checked:
    """What the checks have found so far: each check reads the config and the earlier findings."""

    config: JobConfig
    world_size: int
    layout: Layout | None = None
    spec: Any = None
    model_args: Any = None
    tokenizer: Any = None  # None: not built (a dry run on a machine without the folder)
    not_checked: list[str] | None = None  # a dry run's lines on what only the cluster can check (preflight)


def _check_layout(c: Checked) -> None:
    c.layout = check_layout(c.config, c.world_size)
    c.spec, c.model_args = model_args_from_config(c.config)


def _layout(c: Checked) -> Layout:
    assert c.layout is not None, "the layout check runs first (CHECKS)"
    return c.layout


def _check_batch(c: Checked) -> None:
    tr, dp = c.config.training, _layout(c).dp
    if tr.global_batch_size > 0 and tr.global_batch_size % (tr.local_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size = {tr.global_batch_size} must be a multiple of training.local_batch_size "
            f"x dp degree = {tr.local_batch_size} x {dp}"
        )


def _check_tokenizer(c: Checked) -> None:
    c.tokenizer = c.spec.build_tokenizer_fn(c.config)
    if c.tokenizer.get_vocab_size() > c.model_args.vocab_size:
        raise ConfigError(
            f"the tokenizer has {c.tokenizer.get_vocab_size()} tokens but model {c.config.model.name} "
            f"{c.config.model.flavor} has vocab_size {c.model_args.vocab_size}"
        )


def _check_experts(c: Checked) -> None:
    config, moe, layout = c.config, c.model_args.moe, _layout(c)
    if moe.expert_kernels == "fp8":
        check_expert_fp8(config, c.model_args, layout)
    if moe.expert_kernels == "quack" and (carry := moe.activation.quack_problem(moe.expert_biases)):
        raise ConfigError(
            f"moe.expert_kernels = 'quack': QuACK {carry} ({config.model.name}); "
            "set moe.expert_kernels = 'torch' or 'auto'"
        )
    # a dry run plans for the real GPUs, where QuACK may be installed
    if moe.expert_kernels == "quack" and config.comm.mode != "fake_backend" and (problem := quack_problem()):
        raise ConfigError(f"moe.expert_kernels = 'quack' {problem}")
    if moe.expert_kernels == "quack" and (varying := varying_rows(moe, layout.ep, layout.etp)):
        raise ConfigError(
            f"moe.expert_kernels = 'quack' with {varying}: the experts' row count changes in every "
            "layer and step, and QuACK tunes its kernels for each new count; set "
            "moe.expert_kernels = 'torch' (or 'auto', which picks it here)"
        )


def _check_paths(c: Checked) -> None:
    config = c.config
    check_initial_hf_load(config, c.model_args)
    hub = check_dataset(config, c.tokenizer, c.model_args)
    if hub and c.not_checked is not None:
        c.not_checked.append(
            f"not checked here: training.dataset_path = '{hub}': a Hub dataset, read by a real "
            "run as it builds its data loader"
        )
    ckpt = config.checkpoint
    _check_folders(c)
    if ckpt.initial_load_path and not os.path.exists(ckpt.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path = '{ckpt.initial_load_path}' does not exist")
    if ckpt.create_seed_checkpoint:
        if c.world_size != 1:
            raise ConfigError("checkpoint.create_seed_checkpoint: run it on a single rank (it must not be sharded)")
        if not ckpt.enable:
            raise ConfigError("checkpoint.create_seed_checkpoint needs checkpoint.enable = true")


def _check_folders(c: Checked) -> None:
    """The folders the run writes, judged where they would be made: every rank looks alike and
    says the same line. A dry run writes only its report (comm.dry_run_json, else into
    job.dump_folder); the run's folders may be the cluster's, so it notes the others."""
    config = c.config
    folders = {"job.dump_folder": config.job.dump_folder}
    if config.checkpoint.enable:
        folders["checkpoint.folder"] = os.path.join(config.job.dump_folder, config.checkpoint.folder)
    written = set(folders)
    if c.not_checked is not None:
        report = config.comm.dry_run_json
        if report:
            folders["comm.dry_run_json"] = os.path.dirname(os.path.abspath(report))
        written = {"comm.dry_run_json" if report else "job.dump_folder"}
    for key, folder in folders.items():
        if problem := folder_problem(folder):
            line = f"{key}: cannot write {folder}: {problem}"
            if key in written:
                raise StorageError(line)
            assert c.not_checked is not None  # only a dry run leaves a folder unwritten
            c.not_checked.append(f"not checked here: {line}")


def _check_resume(c: Checked) -> None:
    check_resume_step(c.config)
    # the checkpoint a resume loads was saved with these settings (checkpoint/manager.py)
    if c.tokenizer is None:
        return
    for line in check_resume(c.config, run_settings(c.config, c.tokenizer, _layout(c).dp)):
        if is_first_rank():
            logger.warning(line)


# every check a run makes before any process group, file or model exists, in order; a real
# run (fold_trainer.main) and a dry run (dryrun.check_config) both run all of them
CHECKS = (
    ("layout", _check_layout),
    ("batch", _check_batch),
    ("tokenizer", _check_tokenizer),
    ("experts", _check_experts),
    ("paths", _check_paths),
    ("resume", _check_resume),
)


def preflight(config: JobConfig, world_size: int, not_checked: list[str] | None = None) -> Layout:
    """Reject bad input before any process group, file or model exists (CHECKS, in order).
    not_checked (a dry run's: what lives on the cluster) collects, as lines, a missing
    tokenizer folder instead of raising, and the checks go on without it, and a Hub dataset,
    which a real run reads as it builds its data loader."""
    checked = Checked(config, world_size, not_checked=not_checked)
    for name, check in CHECKS:
        try:
            check(checked)
        except FileNotFoundError as e:
            if name != "tokenizer" or not_checked is None:
                raise
            not_checked.append(f"not checked here: {e}")
    return _layout(checked)


def check_expert_fp8(config: JobConfig, model_args: TransformerArgs, layout: Layout) -> None:
    # a dry run plans for the real GPUs: only the shape rule applies on its host
    capability: tuple[int, int] | None
    if config.comm.mode == "fake_backend":
        capability = (9, 0)
    else:
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    problem = fp8_problem(model_args.dim, model_args.moe.moe_ffn_dim // layout.etp, capability)
    if problem:
        raise ConfigError(f"moe.expert_kernels = 'fp8': {problem}")


# the names LayoutError messages give the degrees (as `name(value)`) -> the job config keys
CONFIG_KEYS = {
    "pp": "parallelism.pipeline_parallel_degree",
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "etp": "parallelism.expert_tensor_parallel_degree",
    "edp": "parallelism.expert_data_parallel_degree",
    "seq_len": "training.seq_len",
}


def check_linear_attention(config: JobConfig, model_args: TransformerArgs) -> None:
    """A model with linear-attention layers: no cp (parallel/attention.py says why), and tp dividing
    the linear attention's key and value heads (tensor parallelism shards them)."""
    if "linear_attention" not in model_args.layer_types:
        return
    p, name = config.parallelism, f"{config.model.name} {config.model.flavor}"
    if p.context_parallel_degree > 1:
        raise ConfigError(
            f"parallelism.context_parallel_degree = {p.context_parallel_degree} with {name}: {LINEAR_ATTENTION_CP}"
        )
    for what in ("linear_n_key_heads", "linear_n_value_heads"):
        heads = getattr(model_args, what)
        if heads % p.tensor_parallel_degree:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree = {p.tensor_parallel_degree} with {name}: its linear attention's "
                f"{heads} {what.removeprefix('linear_n_').replace('_', ' ')} are sharded by tp, which must divide them"
            )


def check_layout(config: JobConfig, world_size: int) -> Layout:
    """The config's degrees, pipeline and MoE settings against the model and the world size."""
    _, model_args = model_args_from_config(config)
    moe = model_args.moe
    if moe.top_k > moe.num_experts:
        raise ConfigError(f"moe.top_k = {moe.top_k}: larger than the model's {moe.num_experts} experts")
    if moe.hot_expert_replicas > moe.num_experts:
        raise ConfigError(
            f"moe.hot_expert_replicas = {moe.hot_expert_replicas}: more copies than the model's "
            f"{moe.num_experts} experts"
        )
    if problem := moe.routing_problem():
        raise ConfigError(problem)
    check_linear_attention(config, model_args)
    try:
        sizes = model_sizes(model_args, config.training.seq_len)
        layout = layout_from_config(config, world_size, sizes).validate(**sizes)
    except LayoutError as e:
        # the rule speaks of ep, tp, ...; the user typed --parallelism.expert_parallel_degree
        named = dict.fromkeys(re.findall(r"\b(\w+)\((-?\d+)\)", str(e)))
        keys = [f"--{CONFIG_KEYS[name]} {value}" for name, value in named if name in CONFIG_KEYS]
        raise LayoutError(f"{', '.join(keys)} (world size {world_size}): {e}") from None
    if layout.pp > 1:
        check_pipeline(config, model_args, layout.pp)
    if problem := overlap_problem(config, layout):
        raise ConfigError(problem)
    return layout
