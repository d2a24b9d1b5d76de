"""titan_fold's job config: torchtitan 0.2.2's JobConfig plus the expert degrees and `[moe]`.

Parsing is torchtitan's ConfigManager (TOML file, then `--section.key value` overrides);
this module adds the fields, resolves a bare config-file name against the packaged
`train_configs/`, checks every TOML value and `--section.key` against its field's type
(no coercion: "false" is not a bool, 4.7 not an int, nan/inf are not numbers) and then
every value against its rule, before any process starts.
"""

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from torchtitan.config import ConfigManager
from torchtitan.config.job_config import ActivationCheckpoint as TitanActivationCheckpoint
from torchtitan.config.job_config import Comm as TitanComm
from torchtitan.config.job_config import Compile as TitanCompile
from torchtitan.config.job_config import Debug as TitanDebug
from torchtitan.config.job_config import JobConfig as TitanJobConfig
from torchtitan.config.job_config import Metrics as TitanMetrics
from torchtitan.config.job_config import Model as TitanModel
from torchtitan.config.job_config import Parallelism as TitanParallelism
from torchtitan.config.job_config import Training as TitanTraining

from titan_fold.common.hints import did_you_mean, reference_key
from titan_fold.common.moe_config import MoE
from titan_fold.common.optimizer_config import Optimizer
from titan_fold.common.ranges import RANGES
from titan_fold.common.rules import broken_rule, move_keys
from titan_fold.common.torchtitan_keys import refusal
from titan_fold.common.values import (
    ConfigError,
    _resolve_config_arg,
    check_cli,
    check_value,
    tyro_args,
)


@dataclass
class Model(TitanModel):
    hf_config: str = ""
    """With flavor = "hf": the config.json (or the Hugging Face folder holding it) that gives
    every size of the model; unset, checkpoint.initial_load_path when initial_load_in_hf.
    See docs/checkpoints.md."""
    max_seq_len: int = 0
    """The longest training.seq_len accepted; 0 = the flavor's context length (max_position_embeddings).
    Set it to train longer sequences on purpose (context extension, e.g. the paper's 128K runs)."""


@dataclass
class Parallelism(TitanParallelism):
    expert_data_parallel_degree: int = -1
    """Data-parallel degree of the expert mesh (edp). -1 = derived:
    world / (pp * expert_parallel_degree * expert_tensor_parallel_degree)."""


@dataclass
class Training(TitanTraining):
    dataset: str = "stdlib"
    """"stdlib": the embedded byte-level corpus (no download); "hf": `dataset_path` read with HF
    datasets (a local .jsonl file with dataset_format = "chat" or "rollouts"); "chat_example": the
    embedded example conversations (dataset_format = "chat"); "rollouts_example": the embedded
    example rollouts, for the debug flavors (dataset_format = "rollouts")."""
    dataset_format: Literal["text", "chat", "rollouts"] = "text"
    """"text": documents (a "text" column) concatenated into one stream cut into seq_len windows;
    "chat": conversations, one jsonl record `{"messages": [{"role", "content"}, ...]}` each, rendered
    with the tokenizer folder's chat template, loss on the assistant turns only, whole
    conversations packed into samples of seq_len tokens (docs/running.md); "rollouts": sampled
    sequences, one jsonl record `{"tokens", "loss_mask", "advantages", "logprobs"}` (and optionally
    "routed_experts") each, loss on the loss_mask tokens, packed likewise (docs/rl.md)."""
    document_masking: bool | None = None
    """Attention within each document of a sample only, positions restarting at each, no loss on
    the token that crosses a boundary. None = on for dataset_format = "chat" and "rollouts", off
    for "text"."""
    long_documents: Literal["truncate", "refuse"] = "truncate"
    """dataset_format = "chat" or "rollouts": a record longer than seq_len tokens is cut to seq_len
    ("truncate", counted in the log and the run summary) or stops the run before training,
    naming the record ("refuse")."""
    objective: Literal["lm", "policy"] = "lm"
    """"lm": the language-model loss (cross-entropy summed over the labelled tokens, divided by
    their global count); "policy": the clipped policy-gradient loss on rollouts against their
    behaviour log-probabilities (dataset_format = "rollouts"), with the same token normalisation;
    no reference model (docs/rl.md, "The policy objective")."""
    policy_clip_low: float = 0.2
    """objective = "policy": the ratio's lower clip epsilon (r clipped to 1 - policy_clip_low)."""
    policy_clip_high: float = 0.28
    """objective = "policy": the ratio's upper clip epsilon (r clipped to 1 + policy_clip_high;
    DAPO's clip-higher)."""
    policy_tis_cap: float = 0.0
    """objective = "policy": truncated importance sampling of the train/inference mismatch, each
    token's term times min(exp(logp_trainer - logp_behaviour), policy_tis_cap) with the trainer's
    log-probability detached; 0 = off."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/Inf loss or gradient norm on any rank: "stop" the run at that step (exit 3, nothing
    saved from it), or "skip" the step (no optimizer step, counted in metrics.jsonl)."""


@dataclass
class ActivationCheckpoint(TitanActivationCheckpoint):
    mode: Literal["selective", "full", "memory_budget", "none", "moe_layers"] = "selective"
    """What backward recomputes: torchtitan's "selective", "full", "memory_budget" or "none", or
    "moe_layers": only the MoE layers (router, dispatch, experts, shared expert), as
    Megatron-Core's --moe-layer-recompute."""
    moe_layer_recompute: bool = False
    """Moved: `moe_layer_recompute = true` is `mode = "moe_layers"` (accepted with a notice)."""


@dataclass
class Comm(TitanComm):
    dry_run_rank: int = 0
    """With mode = "fake_backend": the rank the dry run simulates; -1 = the first and the last
    rank of every pipeline stage."""
    dry_run_collectives: bool = True
    """With mode = "fake_backend": also record one step's collectives on every rank (shrunk
    model, same layout) and check that all members of each process group issue the same sequence."""
    check_gradients: bool = False
    """With mode = "fake_backend": check every parameter's gradient reductions and its share of
    the gradient norm in the recorded step against the placement plan, on every rank with
    dry_run_collectives, else on one rank per position (docs/parallelize.md, "Gradients proven
    before launch"); exit 1 on a mismatch."""
    dry_run_json: str = ""
    """Where the dry run writes its JSON report; empty = <job.dump_folder>/dry_run.json."""
    dry_run_verbose: bool = False
    """With mode = "fake_backend": also print the simulated ranks' own log lines (each rank's
    set-up, as a real run logs it); by default the report alone."""


@dataclass
class Metrics(TitanMetrics):
    step_phases: bool = False
    """Host and GPU milliseconds per phase of every logged step (data, forward, backward, clip,
    optimizer, rest) in metrics.jsonl and the step line, from the host's clock and CUDA events
    (no profiler, no added sync): which phases are host-bound (trainer/phases.py)."""
    expert_load: bool = False
    """Each MoE layer's routed tokens per expert over the logged interval, summed over all ranks: a
    summary per layer in metrics.jsonl (busiest expert and busiest ep rank over the mean, the
    hottest experts), the full counts in expert_load.jsonl, histograms in TensorBoard
    (trainer/expert_load.py). Costs an all-reduce of [MoE layers, experts] at a logged step."""
    group_grad_norms: bool = False
    """Each parameter group's gradient norm (before clipping) and the norm of its update (the
    weights after the optimizer step less those before) in metrics.jsonl at every logged step:
    embedding, attention, norms, router, routed_experts, shared_experts, dense_ffn, head, mtp
    (models/groups.py). Costs a copy of the weights and a wait for the device at a logged step."""


@dataclass
class Compile(TitanCompile):
    cudagraphs: bool = False
    """Each compiled block's forward and backward replayed as CUDA graphs (torch.compile
    mode="reduce-overhead"): no host launch work per kernel. Needs compile.enable; the layer must
    have no host sync (dropless on one EP rank or with moe.exchange = "static", or
    moe.token_drop = "drop_and_pad"). At ep > 1 measured slower than compiled alone (docs/moe.md,
    "What each option costs")."""


@dataclass
class Debug(TitanDebug):
    seed: int | None = 0
    """Base RNG seed (weights, data-independent randomness). A fixed default, so the same command
    gives the same losses; pass another value to vary the run."""
    shrink: bool = False
    """Try the config small: its family's debug model, a short sequence and batch, a few steps in
    fp32, no compile, recompute or checkpoint, the degrees fitted to the ranks launched (keeping
    the folding's shape where it fits), into `<dump_folder>_shrunk`; the changes are printed
    (docs/running.md)."""


@dataclass
class MTP:
    """Multi-Token Prediction (DeepSeek-V3; Megatron-Core's --mtp-num-layers, --mtp-loss-scaling-factor)."""

    num_layers: int = 0
    """Extra blocks after the last layer, the k-th predicting the token k + 1 positions ahead; 0 = off."""
    loss_scaling_factor: float = 0.1
    """Their mean loss enters backward times this factor (logged as mtp_loss, unscaled)."""


@dataclass
class JobConfig(TitanJobConfig):
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    comm: Comm = field(default_factory=Comm)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    debug: Debug = field(default_factory=Debug)
    moe: MoE = field(default_factory=MoE)
    mtp: MTP = field(default_factory=MTP)


# floats where inf means something (no clipping); nan is meaningless everywhere
def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every `section.key` of a config class, nested sections included."""
    hints = typing.get_type_hints(cls)
    return [
        key
        for f in dataclasses.fields(cls)
        for key in (
            _keys(hints[f.name], f"{prefix}{f.name}.")
            if dataclasses.is_dataclass(hints[f.name])
            else [f"{prefix}{f.name}"]
        )
    ]


def _check_toml(table: dict, cls: type, prefix: str = "") -> None:
    """Unknown keys, and every value against its field's type (tyro checks only the CLI, and coerces)."""
    hints = typing.get_type_hints(cls)
    for key, value in table.items():
        name = f"{prefix}{key}"
        if key not in hints:
            if refused := reference_key(name):
                raise ConfigError(refused)
            known = ", ".join(sorted(f.name for f in dataclasses.fields(cls)))
            raise ConfigError(
                f"unknown key '{name}' in the config file (valid here: {known})"
                + did_you_mean(key, [f.name for f in dataclasses.fields(cls)], lambda k: prefix + k)
            )
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"'{name}' must be a [{name}] table")
            _check_toml(value, hints[key], f"{name}.")
        else:
            check_value(name, hints[key], value)


def _field(cls: type, dotted: str) -> Any:
    """The type hint of `section.key` (nested sections allowed), or None."""
    hint: Any = cls
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(hint):
            return None
        hint = typing.get_type_hints(hint).get(part)
    return None if dataclasses.is_dataclass(hint) else hint


def check_ranges(config: JobConfig) -> None:
    """Every numeric key against its range (RANGES)."""
    for key, rule, ok in RANGES:
        value = config
        for part in key.split("."):
            value = getattr(value, part)
        if value is not None and not ok(value):
            raise ConfigError(f"{key} = {value!r}: must be {rule}")


def validate(config: JobConfig) -> None:
    """Ranges, refused torchtitan keys, moved keys and the rules between keys (common/rules.py):
    what holds for any model and world size; degrees against the world come later."""
    check_ranges(config)
    if problem := refusal(config):
        raise ConfigError(problem)
    if problem := move_keys(config) or broken_rule(config):
        raise ConfigError(problem)


# the keys only a dry run reads, and what a real run given one would not do
DRY_RUN_ONLY = {
    "comm.check_gradients": "nothing would check the gradients",
    "comm.dry_run_rank": "no rank is simulated",
    "comm.dry_run_collectives": "no step's collectives are recorded",
    "comm.dry_run_json": "no report is written",
    "comm.dry_run_verbose": "no simulated rank logs",
}


def check_dry_run_keys(config: JobConfig, named: set[str]) -> None:
    """Outside a dry run, a dry-run key named on the command line, or set in the config file to
    turn something on, is refused (a file's `false` only turns a part of its dry run off, as
    deepseek_v3_671b.toml does with the collectives of its 1024 ranks)."""
    if config.comm.mode == "fake_backend":
        return
    for key, lost in DRY_RUN_ONLY.items():
        name = key.partition(".")[2]
        value = getattr(config.comm, name)
        if key in named or (value != getattr(Comm(), name) and value is not False):
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            raise ConfigError(
                f'{key} = {shown}: only with comm.mode = "fake_backend" (the dry run); '
                f"comm.mode is {config.comm.mode!r}, where {lost}"
            )


def parse_args(args: list[str] | None = None) -> JobConfig:
    """TOML + CLI overrides through torchtitan's ConfigManager, then titan_fold's rules."""
    args, path = _resolve_config_arg(sys.argv[1:] if args is None else args)
    if path is not None:
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"job.config_file: {path} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"job.config_file: {path} cannot be read ({e.strerror})") from None
        _check_toml(table, JobConfig)
    named = check_cli(args, lambda key: _field(JobConfig, key), lambda: _keys(JobConfig))
    config = ConfigManager(JobConfig).parse_args(tyro_args(args, lambda key: _field(JobConfig, key)))
    validate(config)
    check_dry_run_keys(config, named)
    return config
