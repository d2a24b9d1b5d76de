"""The job config's rules between keys, in one table of (condition, message), and the moved
keys read as their new ones: config.validate applies both before any process starts;
docs/configuration.md prints them (`python -m titan_fold.common.rules`). Rules that need the
world size, the model or the machine (degrees, the GPU, files) are checked at launch
(trainer/preflight.py). A feature's limits are one row (`Limits`: the settings it is refused
with, and all it runs with), and so are settings that are one decision (`OneOf`)."""

import dataclasses
import itertools
import re
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from titan_fold.common.moe_config import batch_overlap


class Rule(NamedTuple):
    """`broken(config)`: the config breaks the rule; `message`: the error line, `{section.key}`
    fields filled from the config (str.format)."""

    broken: Callable[[Any], bool]
    message: str

    def rules(self) -> tuple["Rule", ...]:
        return (self,)


class Limits(NamedTuple):
    """One feature's limits in one rule: where `on(config)` holds, the first of `refused` that
    is set gives the line `<feature> with <setting>: <runs_with>`, which says all the feature
    runs with (`{section.key}` fields filled from the config)."""

    feature: str
    on: Callable[[Any], bool]
    refused: tuple[tuple[str, Callable[[Any], bool]], ...]
    runs_with: str

    def rules(self) -> tuple[Rule, ...]:
        return tuple(
            Rule(self._refuses(is_set), f"{self.feature} with {setting}: {self.runs_with}")
            for setting, is_set in self.refused
        )

    def _refuses(self, is_set: Callable[[Any], bool]) -> Callable[[Any], bool]:
        return lambda c: self.on(c) and is_set(c)


class OneOf(NamedTuple):
    """Settings that are one decision: any two set give the line `<first> with <second>: <why>`."""

    settings: tuple[tuple[str, Callable[[Any], bool]], ...]
    why: str

    def rules(self) -> tuple[Rule, ...]:
        pairs = itertools.combinations(self.settings, 2)
        return tuple(Rule(self._both(a, b), f"{first} with {second}: {self.why}") for (first, a), (second, b) in pairs)

    @staticmethod
    def _both(a: Callable[[Any], bool], b: Callable[[Any], bool]) -> Callable[[Any], bool]:
        return lambda c: a(c) and b(c)


def _muon(c) -> bool:
    return c.optimizer.name == "Muon"


def _dropless(c) -> bool:
    return c.moe.token_drop == "dropless"


def _device(c) -> bool:
    return c.moe.exchange == "device"


def documents_masked(training) -> bool:
    """training.document_masking as set, or its default for the dataset format (on for chat and
    rollouts)."""
    masking = training.document_masking
    return training.dataset_format in ("chat", "rollouts") if masking is None else masking


def _masked_with(on: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """Broken when packed documents are masked and `on` holds."""
    return lambda c: documents_masked(c.training) and on(c)


def _over_ranks(c) -> bool:
    return c.parallelism.expert_parallel_degree * c.parallelism.expert_tensor_parallel_degree > 1


# the pipeline schedules parallel/overlap.py's overlapped_pipeline runs, by their
# parallelism.pipeline_parallel_schedule names
OVERLAP_SCHEDULES = ("1F1B", "Interleaved1F1B")


def _compiled(c) -> bool:
    return c.compile.enable and "model" in c.compile.components


def _overlap_schedule_missing(c) -> bool:
    schedule = c.parallelism.pipeline_parallel_schedule.lower()
    return c.parallelism.pipeline_parallel_degree > 1 and schedule not in [s.lower() for s in OVERLAP_SCHEDULES]


def _overlapped(c) -> bool:
    return c.moe.ep_overlap != "off"


def _batched(c) -> bool:
    return batch_overlap(c.moe.ep_overlap)


RULES: tuple[Rule | Limits | OneOf, ...] = (
    Rule(
        lambda c: c.moe.token_drop != "dropless" and c.moe.capacity_factor is None,
        "moe.token_drop = {moe.token_drop!r} needs moe.capacity_factor (capacity = ceil(tokens * top_k * "
        "capacity_factor / experts))",
    ),
    Rule(
        lambda c: _dropless(c) and c.moe.drop_policy is not None,
        "moe.drop_policy = {moe.drop_policy!r} needs moe.capacity_factor (dropless mode drops nothing)",
    ),
    Rule(
        lambda c: _dropless(c) and c.moe.drop_scope is not None,
        "moe.drop_scope = {moe.drop_scope!r} needs moe.capacity_factor (dropless mode drops nothing)",
    ),
    Rule(
        lambda c: _dropless(c) and c.moe.capacity_factor is not None,
        "moe.capacity_factor = {moe.capacity_factor} with moe.token_drop = 'dropless': dropless routing "
        "has no capacity; unset moe.capacity_factor or choose moe.token_drop = 'drop'",
    ),
    Rule(
        lambda c: c.moe.load_balance in ("none", "aux_free") and bool(c.moe.aux_loss_coeff),
        "moe.aux_loss_coeff = {moe.aux_loss_coeff} has no effect with moe.load_balance = '{moe.load_balance}'",
    ),
    Rule(
        lambda c: bool(c.model.hf_config) and c.model.flavor != "hf",
        "model.hf_config is read only with model.flavor = 'hf' (flavor is {model.flavor!r})",
    ),
    OneOf(
        (
            ("optimizer.name = 'Muon'", _muon),
            ("optimizer.master_weights = true", lambda c: c.optimizer.master_weights),
            ("optimizer.early_step_in_backward = true", lambda c: c.optimizer.early_step_in_backward),
        ),
        "each is a way to step the parameters (Muon: whole matrices after backward, in the parameters' "
        "dtype; master weights: fp32 copies after backward; the early step: each parameter in backward, "
        "as its gradient arrives); choose one",
    ),
    Rule(
        lambda c: c.optimizer.master_weights and c.training.dtype != "bfloat16",
        "optimizer.master_weights = true with training.dtype = '{training.dtype}': master weights "
        "are for bf16 model parameters; set training.dtype = 'bfloat16'",
    ),
    Rule(
        lambda c: c.compile.cudagraphs and not c.compile.enable,
        "compile.cudagraphs = true needs compile.enable (the graphs are torch.compile's)",
    ),
    Rule(
        lambda c: c.moe.exchange == "static" and not _dropless(c),
        "moe.exchange = 'static' with moe.capacity_factor = {moe.capacity_factor}: it is for dropless "
        "routing; token drop has moe.token_drop = 'drop_and_pad' for static shapes",
    ),
    Limits(
        "moe.exchange = 'device'",
        _device,
        (
            (
                "parallelism.expert_tensor_parallel_degree = {parallelism.expert_tensor_parallel_degree} and "
                "expert_parallel_degree = 1",
                lambda c: c.parallelism.expert_parallel_degree == 1 and c.parallelism.expert_tensor_parallel_degree > 1,
            ),
            ("moe.capacity_factor = {moe.capacity_factor}", lambda c: not _dropless(c)),
            ("compile.cudagraphs = true", lambda c: c.compile.cudagraphs),
        ),
        "the device exchange is for dropless routing over ep > 1 (it starts with the ep all-to-all), "
        "without CUDA graphs (their trees refuse its op); token drop has moe.token_drop = 'drop_and_pad', "
        "CUDA graphs moe.exchange = 'static'",
    ),
    Limits(
        "moe.hot_expert_replicas = {moe.hot_expert_replicas}",
        lambda c: c.moe.hot_expert_replicas > 0,
        (
            ("moe.exchange = '{moe.exchange}'", lambda c: c.moe.exchange in ("static", "device")),
            ("moe.capacity_factor = {moe.capacity_factor}", lambda c: not _dropless(c)),
            ("moe.ep_overlap = '{moe.ep_overlap}'", _overlapped),
            ("moe.expert_kernels = 'fp8'", lambda c: c.moe.expert_kernels == "fp8"),
            ("compile.cudagraphs = true", lambda c: c.compile.cudagraphs),
            ("parallelism.expert_parallel_degree = 1", lambda c: c.parallelism.expert_parallel_degree == 1),
        ),
        "the copies spread the busiest experts' rows over ep > 1 ranks, planned on the exact exchange's "
        "sizes on the host, for dropless routing (a capacity is per expert, and a copy would split it); they "
        "run with moe.exchange = 'exact' or 'auto', moe.ep_overlap = 'off', torch's or QuACK's expert kernels "
        "and no CUDA graphs",
    ),
    Limits(
        "moe.stash_rows = {moe.stash_rows}",
        lambda c: c.moe.stash_rows > 0,
        (
            ("moe.exchange = '{moe.exchange}'", lambda c: c.moe.exchange != "static"),
            (
                "activation_checkpoint.mode = '{activation_checkpoint.mode}'",
                lambda c: c.activation_checkpoint.mode != "none",
            ),
            ("compile.cudagraphs = true", lambda c: c.compile.cudagraphs),
        ),
        "the stash keeps the static exchange's real rows of the tensors the experts save for backward, so "
        "it runs with moe.exchange = 'static' and activation_checkpoint.mode = 'none' (recomputed tensors "
        "are not saved), and without CUDA graphs (the experts run eagerly between the layer's graphs, and "
        "the graph trees would record again in most steps)",
    ),
    Rule(
        lambda c: c.compile.cudagraphs and _over_ranks(c) and _dropless(c) and c.moe.exchange in ("auto", "exact"),
        "compile.cudagraphs = true with dropless routing over parallelism.expert_parallel_degree x "
        "expert_tensor_parallel_degree > 1: the exchange sizes reach the host in every layer "
        "(a graph per shape); set moe.exchange = 'static'",
    ),
    Rule(
        lambda c: (
            c.moe.expert_kernels == "fp8" and "bfloat16" not in (c.training.dtype, c.training.mixed_precision_param)
        ),
        "moe.expert_kernels = 'fp8' with training.dtype = '{training.dtype}' and training.mixed_precision_param = "
        "'{training.mixed_precision_param}': FP8 experts take bf16 activations; set either to 'bfloat16'",
    ),
    *(
        Rule(
            _masked_with(on),
            f"training.document_masking with {key}: {why} does not take packed documents yet; "
            "set training.document_masking = false",
        )
        for key, on, why in (
            ("mtp.num_layers = {mtp.num_layers}", lambda c: c.mtp.num_layers > 0, "Multi-Token Prediction"),
            ("moe.ep_overlap = '{moe.ep_overlap}'", _batched, "the overlapped micro-batch schedule"),
        )
    ),
    Rule(
        lambda c: (
            documents_masked(c.training)
            and c.parallelism.context_parallel_degree > 1
            and c.moe.drop_scope == "full_sequence"
        ),
        "moe.drop_scope = 'full_sequence' with training.document_masking under "
        "parallelism.context_parallel_degree = {parallelism.context_parallel_degree}: the drop decision "
        "reads each sequence in the two-chunk cp order, and packed documents are dealt in blocks of "
        "their own; set moe.drop_scope = 'sub_sequence' or training.document_masking = false",
    ),
    Limits(
        "moe.ep_overlap = '{moe.ep_overlap}'",
        _overlapped,
        (
            ("moe.exchange = 'device'", _device),
            ("parallelism.expert_parallel_degree = 1", lambda c: c.parallelism.expert_parallel_degree == 1),
            ("compile.enable", _compiled),
            (
                "parallelism.pipeline_parallel_schedule = {parallelism.pipeline_parallel_schedule!r}",
                lambda c: _batched(c) and _overlap_schedule_missing(c),
            ),
            ("mtp.num_layers = {mtp.num_layers}", lambda c: _batched(c) and c.mtp.num_layers > 0),
            (
                "activation_checkpoint.mode = '{activation_checkpoint.mode}'",
                lambda c: _batched(c) and c.activation_checkpoint.mode != "none",
            ),
            ("moe.routing_replay = '{moe.routing_replay}'", lambda c: _batched(c) and c.moe.routing_replay != "off"),
        ),
        "it hides the expert all-to-all of ep > 1 behind work run between the pieces of eager blocks "
        "(not one compiled graph), with the exact or static exchange; 'batch' and 'batch_wgrad' pair the "
        f"backward and forward of a {' or '.join(OVERLAP_SCHEDULES)} steady state and run the main model's "
        "blocks only, not recomputed, without replayed experts",
    ),
    Rule(
        lambda c: c.training.objective == "policy" and c.training.dataset_format != "rollouts",
        "training.objective = 'policy' with training.dataset_format = '{training.dataset_format}': the policy "
        "loss needs each token's behaviour log-probability and advantage; set training.dataset_format = 'rollouts'",
    ),
    Rule(
        lambda c: c.moe.routing_replay == "rollout" and c.training.dataset_format != "rollouts",
        "moe.routing_replay = 'rollout' with training.dataset_format = '{training.dataset_format}': only "
        "rollout files carry the inference engine's routed_experts; set training.dataset_format = 'rollouts'",
    ),
    Rule(
        lambda c: bool(c.checkpoint.initial_load_path) and not c.checkpoint.enable,
        "checkpoint.initial_load_path = {checkpoint.initial_load_path!r} needs checkpoint.enable "
        "(without it nothing would be loaded and training would start from random weights)",
    ),
)

OWN = object()  # in Moved.reads: the old key's own value


class Moved(NamedTuple):
    """`section.old`, set, is read as `section.new = reads[now]`, `now` being new's value, with a
    one-line notice; a `now` not in `reads` (nor the value read) is refused: both set apart."""

    section: str
    old: str
    new: str
    reads: dict[Any, Any]


def _moved(section: str, old: str, new: str, value: str, *unset: str | None) -> Moved:
    """`section.old = true` read as `section.new = value`, where new is one of `unset` (the values
    the old key went with)."""
    return Moved(section, old, new, dict.fromkeys(unset, value))


MOVED = (
    _moved("moe", "static_ep_exchange", "exchange", "static", "auto"),
    _moved("moe", "pad_to_capacity", "token_drop", "drop_and_pad", None),
    _moved("activation_checkpoint", "moe_layer_recompute", "mode", "moe_layers", "none"),
    Moved("moe", "grouped_gemm", "expert_kernels", {"auto": OWN}),
    _moved("moe", "expert_fp8", "expert_kernels", "fp8", "auto", "torch"),  # FP8 ran on torch's kernels
    _moved("moe", "delay_wgrad_compute", "ep_overlap", "wgrad", "off"),
    Moved("moe", "overlap_ep_comm", "ep_overlap", {"off": "batch", "wgrad": "batch_wgrad"}),
)


def _shown(value) -> str:
    return "true" if value is True else repr(value)


def move_keys(config) -> str | None:
    """Read each moved key that is set as its new key (a notice on stderr, the old key reset to
    its default); -> the error line where both are set apart, else None."""
    for section, old, new, reads in MOVED:
        owner = getattr(config, section)
        was = getattr(owner, old)
        if was is None or was is False:
            continue
        now = getattr(owner, new)
        read = {key: was if value is OWN else value for key, value in reads.items()}
        value = read.get(now, now)
        if value not in read.values():
            return (
                f"{section}.{old} = {_shown(was)} with {section}.{new} = {now!r}: the old key moved to "
                f"{section}.{new}; set only {section}.{new}"
            )
        print(f'notice: {section}.{old} moved to {section}.{new}; read as {section}.{new} = "{value}"', file=sys.stderr)
        setattr(owner, new, value)
        setattr(owner, old, next(f.default for f in dataclasses.fields(owner) if f.name == old))
    moe = config.moe
    if moe.token_drop is None:  # unset: token drop where a capacity factor is given
        moe.token_drop = "dropless" if moe.capacity_factor is None else "drop"
    return None


def _fields(config) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def rule_list() -> list[Rule]:
    """Every rule, in the order they are checked."""
    return [rule for entry in RULES for rule in entry.rules()]


def broken_rule(config) -> str | None:
    """The first rule the config breaks, as its error line; None if it breaks none."""
    for rule in rule_list():
        if rule.broken(config):
            return rule.message.format(**_fields(config))
    return None


def _read_as(m: Moved) -> str:
    key = f"{m.section}.{m.new}"
    if OWN in m.reads.values():
        return f"X  is read as  {key} = X"
    first, *more = m.reads.items()
    also = "".join(f'; "{v}" where {key} = "{k}"' for k, v in more if v != first[1])
    return f'true  is read as  {key} = "{first[1]}"{also}'


def _template(message: str) -> str:
    return re.sub(r"\{([\w.]+)(![rs])?\}", r"<\1>", message)


def table() -> str:
    """The rules' messages, `<KEY>` for a value from the config (a feature's limits in one line,
    the settings it is refused with joined by |), then the moved keys."""
    lines = []
    for entry in RULES:
        if isinstance(entry, Limits):
            settings = " | ".join(setting for setting, _ in entry.refused)
            lines.append(_template(f"{entry.feature} with {settings}: {entry.runs_with}"))
        elif isinstance(entry, OneOf):
            settings = " | ".join(setting for setting, _ in entry.settings)
            lines.append(_template(f"at most one of {settings}: {entry.why}"))
        else:
            lines.append(_template(entry.message))
    lines += [f"{m.section}.{m.old} = {_read_as(m)} (with a notice)" for m in MOVED]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
