"""titan_fold's job config: torchtitan 0.2.2's JobConfig plus the expert degrees and `[moe]`.

Parsing is torchtitan's ConfigManager (TOML file, then `--section.key value` overrides);
this module adds the fields, resolves a bare config-file name against the packaged
`train_configs/`, and checks every value against its rule before any process starts.
"""

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan.config import ConfigManager
from torchtitan.config.job_config import ActivationCheckpoint as TitanActivationCheckpoint
from torchtitan.config.job_config import JobConfig as TitanJobConfig
from torchtitan.config.job_config import Optimizer as TitanOptimizer
from torchtitan.config.job_config import Parallelism as TitanParallelism
from torchtitan.config.job_config import Training as TitanTraining

from titan_fold.errors import UserError

PACKAGED_CONFIGS = Path(__file__).parent / "train_configs"


class ConfigError(UserError, ValueError):
    """A job config value breaks a rule; the message names the key and the rule."""


@dataclass
class Parallelism(TitanParallelism):
    expert_data_parallel_degree: int = -1
    """Data-parallel degree of the expert mesh (edp). -1 = derived:
    world / (pp * expert_parallel_degree * expert_tensor_parallel_degree)."""


@dataclass
class Training(TitanTraining):
    dataset: str = "stdlib"
    """"stdlib": the embedded byte-level corpus (no download); "hf": `dataset_path` read with HF datasets."""


@dataclass
class Optimizer(TitanOptimizer):
    master_weights: bool = False
    """Keep fp32 master weights and fp32 optimizer states in the optimizer while the model's
    parameters are bf16 (training.dtype = "bfloat16"): bf16 compute without autocast, the
    fp32 recipe's update (titan_fold/optimizer.py)."""


@dataclass
class ActivationCheckpoint(TitanActivationCheckpoint):
    moe_layer_recompute: bool = False
    """Recompute only the MoE layers (router, dispatch, experts, shared expert) in backward,
    as Megatron-Core's --moe-layer-recompute; with mode = "none"."""


@dataclass
class MoE:
    """Router and capacity settings. Unset (None) keeps the model flavor's value."""

    capacity_factor: float | None = None
    """Token-drop capacity factor; unset = dropless. capacity = ceil(tokens * top_k * cf / E)."""
    pad_to_capacity: bool | None = None
    """Pad every expert to its capacity (static shapes; needs capacity_factor)."""
    drop_policy: Literal["probs", "position"] | None = None
    """Which tokens an over-full expert keeps: highest probability, or first in order."""
    drop_scope: Literal["sub_sequence", "full_sequence"] | None = None
    """Decide drops on this rank's tokens, or on the whole sequences (gathered over cp x tp)."""
    score_func: Literal["softmax", "sigmoid"] | None = None
    top_k: int | None = None
    norm_topk_prob: bool | None = None
    """Renormalize the top-k probabilities to sum to one."""
    load_balance: Literal["aux_loss", "seq_aux_loss", "aux_free", "none"] | None = None
    shared_expert_overlap: bool | None = None
    """Run the shared expert while the routed tokens' all-to-all is in flight (default true)."""
    aux_loss_coeff: float | None = None
    z_loss_coeff: float | None = None


@dataclass
class JobConfig(TitanJobConfig):
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    moe: MoE = field(default_factory=MoE)


def resolve_config_file(path: str) -> str:
    """A name not found from the working directory is looked up in the packaged configs."""
    if os.path.exists(path):
        return path
    packaged = PACKAGED_CONFIGS / path
    if os.sep not in path and packaged.exists():
        return str(packaged)
    available = ", ".join(sorted(p.name for p in PACKAGED_CONFIGS.glob("*.toml")))
    raise ConfigError(f"job.config_file: '{path}' does not exist (packaged configs: {available})")


def _resolve_config_arg(args: list[str]) -> tuple[list[str], str | None]:
    args, path = list(args), None
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            if eq:
                path = resolve_config_file(value)
                args[i] = f"{key}={path}"
            elif i + 1 < len(args):
                path = args[i + 1] = resolve_config_file(args[i + 1])
    return args, path


def _literal_choices(hint) -> tuple | None:
    for arg in (hint, *typing.get_args(hint)):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


def _check_toml(table: dict, cls: type, prefix: str = "") -> None:
    """Unknown keys and values outside a Literal's choices (tyro checks only the CLI)."""
    hints = typing.get_type_hints(cls)
    for key, value in table.items():
        name = f"{prefix}{key}"
        if key not in hints:
            known = ", ".join(sorted(f.name for f in dataclasses.fields(cls)))
            raise ConfigError(f"unknown key '{name}' in the config file (valid here: {known})")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"'{name}' must be a [{name}] table")
            _check_toml(value, hints[key], f"{name}.")
        elif (choices := _literal_choices(hints[key])) is not None and value not in choices:
            raise ConfigError(f"{name} = {value!r}: must be one of {list(choices)}")


def validate(config: JobConfig) -> None:
    """Rules that hold for any model and world size; degrees against the world come later."""
    moe, par, tr = config.moe, config.parallelism, config.training
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(f"moe.capacity_factor = {moe.capacity_factor}: must be > 0 (unset it for dropless)")
    if moe.capacity_factor is None:
        for key in ("pad_to_capacity", "drop_policy", "drop_scope"):
            value = getattr(moe, key)
            if value not in (None, False):
                raise ConfigError(f"moe.{key} = {value!r} needs moe.capacity_factor (dropless mode drops nothing)")
    if moe.top_k is not None and moe.top_k < 1:
        raise ConfigError(f"moe.top_k = {moe.top_k}: must be >= 1")
    for key in ("aux_loss_coeff", "z_loss_coeff"):
        value = getattr(moe, key)
        if value is not None and value < 0:
            raise ConfigError(f"moe.{key} = {value}: must be >= 0")
    if moe.load_balance in ("none", "aux_free") and moe.aux_loss_coeff:
        raise ConfigError(f"moe.aux_loss_coeff = {moe.aux_loss_coeff} has no effect with moe.load_balance = '{moe.load_balance}'")
    for key in ("tensor_parallel_degree", "context_parallel_degree", "pipeline_parallel_degree",
                "data_parallel_replicate_degree", "expert_parallel_degree", "expert_tensor_parallel_degree"):
        if getattr(par, key) < 1:
            raise ConfigError(f"parallelism.{key} = {getattr(par, key)}: must be >= 1")
    for key in ("data_parallel_shard_degree", "expert_data_parallel_degree"):
        value = getattr(par, key)
        if value != -1 and value < 1:
            raise ConfigError(f"parallelism.{key} = {value}: must be >= 1, or -1 to derive it")
    ac = config.activation_checkpoint
    if ac.moe_layer_recompute and ac.mode != "none":
        raise ConfigError(
            f"activation_checkpoint.moe_layer_recompute with activation_checkpoint.mode = '{ac.mode}': "
            "choose one; moe_layer_recompute needs mode = 'none'"
        )
    opt = config.optimizer
    if opt.master_weights and tr.dtype != "bfloat16":
        raise ConfigError(f"optimizer.master_weights = true with training.dtype = '{tr.dtype}': master weights "
                          "are for bf16 model parameters; set training.dtype = 'bfloat16'")
    if opt.master_weights and opt.early_step_in_backward:
        raise ConfigError("optimizer.master_weights = true with optimizer.early_step_in_backward: choose one")
    if tr.seq_len < 1 or tr.local_batch_size < 1 or tr.steps < 0:
        raise ConfigError("training.seq_len and training.local_batch_size must be >= 1, training.steps >= 0")


def parse_args(args: list[str] | None = None) -> JobConfig:
    """TOML + CLI overrides through torchtitan's ConfigManager, then titan_fold's rules."""
    args, path = _resolve_config_arg(sys.argv[1:] if args is None else args)
    if path is not None:
        with open(path, "rb") as f:
            try:
                _check_toml(tomllib.load(f), JobConfig)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"job.config_file: {path} is not valid TOML: {e}") from None
    config = ConfigManager(JobConfig).parse_args(args)
    validate(config)
    return config
