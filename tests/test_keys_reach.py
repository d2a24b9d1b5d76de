"""Every key of [model], [moe], [mtp], [optimizer] and [lr_scheduler] reaches what it configures.

Each key is in one of two tables. CHANGES: set to another value than its base's, the key changes
what the trainer builds from the config: the model (its parameters' names and shapes, on the meta
device), its forward (the logits of a fixed batch, or the gradients their loss gives: aux losses
and MTP enter through backward), the optimizers' param groups, or the lr of every step. REACHES:
keys that cannot change any of those on one CPU rank, each with the reason, and what shows that
the key gets where it is read (the built layer's attribute, the tokenizer built, the container
the trainer builds). The sections' keys are read from the config's dataclasses, so a new key
fails test_every_key_is_classified until it is in one of the tables.

The builds are the trainer's: preflight.model_args_from_config (the train spec's model args with
the job's update_from_config), the spec's model class, torchtitan's model converters, the spec's
build_optimizers_fn and build_lr_schedulers_fn after fold_trainer.fit_warmup. Debug flavors, two
samples of 32 tokens, float32 on the CPU: a few seconds in all.
"""

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable
from typing import Any, Literal
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.utils import set_default_dtype

from titan_fold.common.config import ConfigError, JobConfig, parse_args

SECTIONS = ("model", "moe", "mtp", "optimizer", "lr_scheduler")
HF = os.path.join(os.path.dirname(__file__), "data", "hf_configs")
COMMON = ("--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "10")
DEEPSEEK = "debug_deepseek_v3.toml"
DROPS = ("--moe.capacity_factor", "0.5")  # half the slots a balanced load needs: tokens are dropped
MTP = ("--mtp.num_layers", "1")
MUON = ("--optimizer.name", "Muon")
EP2 = ("--parallelism.expert_parallel_degree", "2")
BF16 = ("--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Change:
    """The key set by `args`, against the same config without them, changes `effect`."""

    effect: Literal["model", "forward", "optimizer", "schedule"]
    args: tuple[str, ...]
    base: tuple[str, ...] = ()  # what both builds share, beside COMMON
    config: str = "debug_moe.toml"


@dataclasses.dataclass(frozen=True)
class Reach:
    """A key that cannot change the model, its forward, the optimizer or the schedule here: why,
    and `reaches(config, model)` == `want` with the key set by `args` (and != without them)."""

    why: str
    args: tuple[str, ...]
    reaches: Callable[[JobConfig, torch.nn.Module], Any]
    want: Any
    base: tuple[str, ...] = ()
    config: str = "debug_moe.toml"
    same_forward: bool = False  # and the forward equals the base's: the key changes speed or memory only


CHANGES: dict[str, Change] = {
    "model.name": Change("model", ("--model.name", "mixtral")),
    "model.flavor": Change("model", ("--model.flavor", "57B-A14B")),
    "model.hf_config": Change(
        "model",
        ("--model.hf_config", os.path.join(HF, "Mixtral-8x22B-v0.1.json")),
        base=("--model.name", "mixtral", "--model.flavor", "hf", "--model.hf_config", f"{HF}/Mixtral-8x7B-v0.1.json"),
    ),
    "moe.capacity_factor": Change("forward", DROPS),
    "moe.drop_policy": Change("forward", ("--moe.drop_policy", "position"), base=DROPS),
    "moe.score_func": Change("forward", ("--moe.score_func", "sigmoid")),
    "moe.top_k": Change("forward", ("--moe.top_k", "1")),
    "moe.norm_topk_prob": Change("forward", ("--moe.norm_topk_prob", "True")),
    "moe.num_groups": Change("forward", ("--moe.num_groups", "4")),
    "moe.group_topk": Change(
        "forward", ("--moe.group_topk", "1"), base=("--moe.num_groups", "4", "--moe.group_topk", "4")
    ),
    "moe.routed_scaling_factor": Change("forward", ("--moe.routed_scaling_factor", "2.5")),
    "moe.load_balance": Change("forward", ("--moe.load_balance", "seq_aux_loss")),
    "moe.aux_loss_coeff": Change("forward", ("--moe.aux_loss_coeff", "0.5")),
    "moe.z_loss_coeff": Change("forward", ("--moe.z_loss_coeff", "0.5")),
    "mtp.num_layers": Change("model", MTP, config=DEEPSEEK),
    "mtp.loss_scaling_factor": Change("forward", ("--mtp.loss_scaling_factor", "0.5"), base=MTP, config=DEEPSEEK),
    "optimizer.name": Change("optimizer", ("--optimizer.name", "Adam")),
    "optimizer.lr": Change("optimizer", ("--optimizer.lr", "1e-4")),
    "optimizer.beta1": Change("optimizer", ("--optimizer.beta1", "0.8")),
    "optimizer.beta2": Change("optimizer", ("--optimizer.beta2", "0.9")),
    "optimizer.eps": Change("optimizer", ("--optimizer.eps", "1e-6")),
    "optimizer.weight_decay": Change("optimizer", ("--optimizer.weight_decay", "0.1")),
    "optimizer.implementation": Change("optimizer", ("--optimizer.implementation", "for-loop")),
    "optimizer.early_step_in_backward": Change("optimizer", ("--optimizer.early_step_in_backward",)),
    "optimizer.master_weights": Change("optimizer", ("--optimizer.master_weights",), base=BF16),
    "optimizer.muon_momentum": Change("optimizer", ("--optimizer.muon_momentum", "0.9"), base=MUON),
    "optimizer.muon_nesterov": Change("optimizer", ("--optimizer.no-muon_nesterov",), base=MUON),
    "optimizer.muon_ns_steps": Change("optimizer", ("--optimizer.muon_ns_steps", "3"), base=MUON),
    "optimizer.muon_ns_coefficients": Change(
        "optimizer", ("--optimizer.muon_ns_coefficients", "3", "-3", "1"), base=MUON
    ),
    "optimizer.muon_lr_adjust": Change("optimizer", ("--optimizer.muon_lr_adjust", "original"), base=MUON),
    "optimizer.muon_ns_dtype": Change("optimizer", ("--optimizer.muon_ns_dtype", "float32"), base=MUON),
    "lr_scheduler.warmup_steps": Change("schedule", ("--lr_scheduler.warmup_steps", "2")),
    "lr_scheduler.total_steps": Change("schedule", ("--lr_scheduler.total_steps", "20")),
    "lr_scheduler.decay_ratio": Change("schedule", ("--lr_scheduler.decay_ratio", "0.2")),
    "lr_scheduler.decay_type": Change("schedule", ("--lr_scheduler.decay_type", "cosine")),
    "lr_scheduler.min_lr_factor": Change("schedule", ("--lr_scheduler.min_lr_factor", "0.5")),
}


def first_moe(model):
    from titan_fold.moe import moe_layers

    return moe_layers(model)[0]


def tokenizer_vocab(config, model) -> int:
    from titan_fold.data import build_tokenizer

    return build_tokenizer(config).get_vocab_size()


def converted(config, model) -> list[str]:
    """The converters the trainer's build_model_converters(config, layout).convert(model) ran:
    torchtitan's own (float8, mx) need torchao and an sm89+ GPU, so a stand-in under a test name."""
    from torchtitan.protocols import model_converter

    from titan_fold.trainer.preflight import check_layout

    ran = []

    class Recording:
        def __init__(self, job_config, parallel_dims):
            pass

        def convert(self, model):
            ran.append(type(model).__name__)

    with mock.patch.dict(model_converter._registry_model_converter_cls, {"test.recording": Recording}):
        model_converter.build_model_converters(config, check_layout(config, 1)).convert(model)
    return ran


def logs_the_converted_model(config, model) -> bool:
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.tools.logging import logger

    from titan_fold.trainer.preflight import check_layout

    with mock.patch.object(logger, "info") as info:
        build_model_converters(config, check_layout(config, 1)).convert(model)
    return any("after conversion" in str(call.args[0]) for call in info.call_args_list)


def with_max_seq_len(config, model) -> int:
    from titan_fold.trainer.preflight import model_args_from_config

    config.training.seq_len = 4096  # above the debug flavor's 2048
    return model_args_from_config(config)[1].max_seq_len


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder = tmp_path_factory.mktemp("tokenizer")
    Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    return str(folder)


TOKENIZER = "{tokenizer}"  # replaced by the tokenizer_folder fixture's path
REACHES: dict[str, Reach] = {
    "model.hf_assets_path": Reach(
        "the tokenizer's folder: the data's ids (preflight checks the model's vocabulary holds them)",
        ("--model.hf_assets_path", TOKENIZER),
        tokenizer_vocab,
        3,
    ),
    "model.tokenizer_path": Reach(
        "torchtitan's old name of model.hf_assets_path, read as it (with a warning)",
        ("--model.tokenizer_path", TOKENIZER),
        tokenizer_vocab,
        3,
    ),
    "model.converters": Reach(
        "torchtitan's converters (float8, mx Linear layers) need torchao and an sm89+ GPU; the "
        "trainer's build_model_converters applies them to the built model",
        ("--model.converters", "test.recording"),
        converted,
        ["Transformer"],
    ),
    "model.print_after_conversion": Reach(
        "only logs the converted model", ("--model.print_after_conversion",), logs_the_converted_model, True
    ),
    "model.max_seq_len": Reach(
        "a limit checked before the build: a training.seq_len up to it is accepted (the model takes "
        "training.seq_len); without it a seq_len above the flavor's is refused",
        ("--model.max_seq_len", "4096"),
        with_max_seq_len,
        4096,
    ),
    "moe.token_drop": Reach(
        "with moe.capacity_factor set (the drops' switch, refused with 'dropless'), it chooses padding "
        "to capacity: padding rows change shapes, not values",
        ("--moe.token_drop", "drop_and_pad"),
        lambda c, m: first_moe(m).args.token_drop,
        "drop_and_pad",
        base=DROPS,
        same_forward=True,
    ),
    "moe.pad_to_capacity": Reach(
        "moved: read as moe.token_drop = 'drop_and_pad', whose padding rows change shapes, not values",
        ("--moe.pad_to_capacity", "True"),
        lambda c, m: first_moe(m).args.token_drop,
        "drop_and_pad",
        base=DROPS,
        same_forward=True,
    ),
    "moe.drop_scope": Reach(
        "drops decided over the whole sequences gathered over cp x tp: on one rank the same tokens",
        ("--moe.drop_scope", "full_sequence"),
        lambda c, m: first_moe(m).args.drop_scope,
        "full_sequence",
        base=DROPS,
        same_forward=True,
    ),
    "moe.shared_expert_overlap": Reach(
        "where the shared expert runs beside the routed tokens' exchange: speed",
        ("--moe.shared_expert_overlap", "False"),
        lambda c, m: first_moe(m).args.shared_expert_overlap,
        False,
        same_forward=True,
    ),
    "moe.expert_kernels": Reach(
        "which kernels run the experts' grouped GEMMs: speed; FP8's values: tests/test_fp8.py",
        ("--moe.expert_kernels", "fp8"),
        lambda c, m: (first_moe(m).experts.fp8, first_moe(m).experts.grouped_gemm),
        (True, "torch"),
        base=BF16,
    ),
    "moe.expert_fp8": Reach(
        "moved: read as moe.expert_kernels = 'fp8'",
        ("--moe.expert_fp8",),
        lambda c, m: first_moe(m).experts.fp8,
        True,
        base=BF16,
    ),
    "moe.grouped_gemm": Reach(
        "moved: read as moe.expert_kernels, the same grouped GEMMs on other kernels",
        ("--moe.grouped_gemm", "torch"),
        lambda c, m: first_moe(m).experts.grouped_gemm,
        "torch",
        same_forward=True,
    ),
    "moe.ep_overlap": Reach(
        "the split weight gradients and two micro-batches interleaved under ep: speed "
        "(tests/test_wgrad.py, tests/test_overlap.py)",
        ("--moe.ep_overlap", "batch_wgrad"),
        lambda c, m: (first_moe(m).experts.wgrad is not None, first_moe(m).args.ep_overlap),
        (True, "batch_wgrad"),
        base=EP2,
    ),
    "moe.delay_wgrad_compute": Reach(
        "moved: read as moe.ep_overlap = 'wgrad'",
        ("--moe.delay_wgrad_compute",),
        lambda c, m: first_moe(m).experts.wgrad is not None,
        True,
        base=EP2,
    ),
    "moe.overlap_ep_comm": Reach(
        "moved: read as moe.ep_overlap = 'batch'",
        ("--moe.overlap_ep_comm",),
        lambda c, m: first_moe(m).args.ep_overlap,
        "batch",
        base=EP2,
    ),
    "moe.exchange": Reach(
        "how the routed tokens cross the ep x etp ranks: speed and memory, nothing at ep = etp = 1",
        ("--moe.exchange", "static"),
        lambda c, m: first_moe(m).args.exchange,
        "static",
        same_forward=True,
    ),
    "moe.static_ep_exchange": Reach(
        "moved: read as moe.exchange = 'static'",
        ("--moe.static_ep_exchange",),
        lambda c, m: first_moe(m).args.exchange,
        "static",
    ),
    "moe.hot_expert_replicas": Reach(
        "copies of hot experts spread the busiest ep rank's rows: speed (tests/test_hot_replicas.py)",
        ("--moe.hot_expert_replicas", "2"),
        lambda c, m: first_moe(m).args.hot_expert_replicas,
        2,
        base=EP2,
    ),
    "moe.routing_replay": Reach(
        "'recorded' replays the routing the current weights choose, so one step's forward is the same; "
        "'rollout' replays the data's routed_experts (tests/test_routing_replay.py)",
        ("--moe.routing_replay", "recorded"),
        lambda c, m: first_moe(m).args.routing_replay,
        "recorded",
        same_forward=True,
    ),
    "moe.stash_rows": Reach(
        "the static exchange's saved activations in one pool: memory (tests/test_static_exchange.py)",
        ("--moe.stash_rows", "4096"),
        lambda c, m: first_moe(m).args.stash_rows,
        4096,
        base=("--moe.exchange", "static", "--activation_checkpoint.mode", "none"),
    ),
}


def section_keys() -> list[str]:
    config = JobConfig()
    return [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(config, s))]


def test_every_key_is_classified():
    keys = section_keys()
    assert not set(CHANGES) & set(REACHES)
    assert sorted(keys) == sorted([*CHANGES, *REACHES])


def job(config_file: str, *args: str) -> JobConfig:
    return parse_args(["--job.config_file", config_file, *COMMON, *args])


def build(config: JobConfig, device: str = "meta") -> torch.nn.Module:
    """The trainer's model for `config`: initialized with seed 0 off the meta device."""
    from titan_fold.trainer.preflight import model_args_from_config

    spec, args = model_args_from_config(config)
    with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = spec.model_cls(args)
    if device != "meta":
        model.to_empty(device=device)
        torch.manual_seed(0)
        model.init_weights()
    return model


def parameters(config: JobConfig) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in build(config).named_parameters()}


def forward(config: JobConfig) -> list[torch.Tensor]:
    """The logits of a fixed batch and every gradient their loss gives (the sum of the
    cross-entropies, as the trainer's loss before its division by the token count)."""
    model = build(config, "cpu")
    logits = forward_of(model)
    return [logits, *(p.grad for p in model.parameters() if p.grad is not None)]


def forward_of(model: torch.nn.Module) -> torch.Tensor:
    """model's logits [2, 32, vocab] of a fixed batch, after the backward of their loss."""
    from titan_fold.models.mtp import future_tokens

    tokens, labels = torch.randint(0, model.args.vocab_size, (2, 2, 32), generator=torch.Generator().manual_seed(1))
    future = future_tokens(tokens, labels, model.args.mtp_layers) if model.args.mtp_layers else None
    logits = model(tokens, future_tokens=future)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    return logits.detach()


def param_groups(config: JobConfig) -> list:
    """Every optimizer's class and param groups: the settings, and each parameter's shape and dtype."""
    from titan_fold.trainer.preflight import check_layout, model_args_from_config

    spec, _ = model_args_from_config(config)
    optimizers = spec.build_optimizers_fn([build(config, "cpu")], config.optimizer, check_layout(config, 1))
    return [
        (type(opt).__name__, [{**g, "params": [(p.shape, p.dtype) for p in g["params"]]} for g in opt.param_groups])
        for opt in optimizers.optimizers
    ]


def schedule(config: JobConfig) -> list[float]:
    """The lr of every step of training.steps, as the trainer's schedulers give it."""
    from titan_fold.trainer.fold_trainer import fit_warmup
    from titan_fold.trainer.preflight import check_layout, model_args_from_config

    fit_warmup(config)
    spec, _ = model_args_from_config(config)
    optimizers = spec.build_optimizers_fn([build(config, "cpu")], config.optimizer, check_layout(config, 1))
    schedulers = spec.build_lr_schedulers_fn(optimizers, config.lr_scheduler, config.training.steps)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the schedulers stepped without their optimizers
        for _ in range(config.training.steps):
            lrs.append(schedulers.schedulers[0].get_last_lr()[0])
            schedulers.step()
    return lrs


def same_forward(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b, strict=True)
    )


EFFECT = {"model": parameters, "forward": forward, "optimizer": param_groups, "schedule": schedule}


@functools.cache
def measured(effect: str, config_file: str, args: tuple[str, ...]):
    """EFFECT[effect] of the job: once per test session for the bases many keys share."""
    return EFFECT[effect](job(config_file, *args))


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_the_key_changes_what_it_configures(key):
    change = CHANGES[key]
    before = measured(change.effect, change.config, change.base)
    after = measured(change.effect, change.config, (*change.base, *change.args))
    if change.effect == "forward":
        assert not same_forward(before, after), f"{key}: the forward and its gradients are the base's"
    else:
        assert before != after, f"{key}: the {change.effect} is the base's"


@pytest.mark.parametrize("key", sorted(REACHES))
def test_the_key_reaches_where_it_is_read(key, tokenizer_folder):
    reach = REACHES[key]
    args = tuple(a.replace(TOKENIZER, tokenizer_folder) for a in reach.args)
    config = job(reach.config, *reach.base, *args)
    assert reach.reaches(config, build(config)) == reach.want, key
    base = job(reach.config, *reach.base)
    try:
        unset = reach.reaches(base, build(base))
    except ConfigError as e:  # refused without the key (model.max_seq_len)
        unset = e
    assert unset != reach.want, f"{key}: the base gives {reach.want!r} too"
    if reach.same_forward:
        assert same_forward(forward(base), forward(config)), f"{key}: changes the forward"


def test_mtp_loss_weight_scales_the_mtp_layers_gradients():
    """mtp.loss_scaling_factor reaches the MTP loss itself: the MTP layer's parameters, which only
    the MTP loss reaches, get 5 times the gradient with 0.5 as with 0.1."""

    def mtp_gradients(factor: str) -> dict[str, torch.Tensor]:
        model = build(job(DEEPSEEK, *MTP, "--mtp.loss_scaling_factor", factor), "cpu")
        forward_of(model)
        return {n: p.grad for n, p in model.named_parameters() if n.startswith("mtp.")}

    low, high = mtp_gradients("0.1"), mtp_gradients("0.5")
    assert low and low.keys() == high.keys()
    for name, grad in low.items():
        largest = grad.abs().max()  # float32 rounding, relative to the tensor's largest gradient
        assert largest > 0 and (high[name] - 5 * grad).abs().max() <= 1e-5 * largest, name
