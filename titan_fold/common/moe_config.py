"""titan_fold's [moe] section: the router, token drop, the experts' kernels and the exchange.

Each key is described once, in `MoEKeys`: its type, the layer's default and its help text.
The layer takes `MoEKeys` plus the flavor's shapes (moe/args.py's `MoEArgs` derives from it);
the job config's section `MoE` is derived from it by code (`section()`): a key a model flavor
sets (not in JOB_KEYS) is `T | None = None` there, unset keeping the flavor's value; a key of
JOB_KEYS keeps the layer's default. The keys that moved (`MovedMoEKeys`) are the section's only.
"""

import ast
import dataclasses
import inspect
import itertools
import json
import textwrap
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union, cast, get_args, get_origin

ExpertKernels = Literal["auto", "torch", "quack", "fp8"]
EpOverlap = Literal["off", "wgrad", "batch", "batch_wgrad"]


def batch_overlap(ep_overlap: str) -> bool:
    """moe.ep_overlap interleaves two micro-batches ("batch", "batch_wgrad")."""
    return ep_overlap.startswith("batch")


def split_wgrad(ep_overlap: str) -> bool:
    """moe.ep_overlap computes the experts' weight gradients apart ("wgrad", "batch_wgrad")."""
    return ep_overlap.endswith("wgrad")


@dataclass
class MoEKeys:
    """The `[moe]` keys as the MoE layer takes them, with the layer's defaults."""

    token_drop: Literal["dropless", "drop", "drop_and_pad"] = "dropless"
    """"dropless": every expert takes all its tokens; "drop": an expert keeps at most its capacity
    (drop_policy chooses which); "drop_and_pad": as "drop", every expert padded to its capacity
    (static shapes, no host sync). Unset: "drop" where capacity_factor is set, else "dropless"."""
    capacity_factor: float | None = None
    """With token drop: capacity = ceil(tokens * top_k * capacity_factor / experts)."""
    drop_policy: Literal["probs", "position"] = "probs"
    """Which tokens an over-full expert keeps: highest probability, or first in order."""
    drop_scope: Literal["sub_sequence", "full_sequence"] = "sub_sequence"
    """Decide drops on this rank's tokens, or on the whole sequences (gathered over cp x tp)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """The router's scores of the experts: a softmax over them, or a sigmoid of each logit."""
    top_k: int = 2
    """Routed experts per token."""
    norm_topk_prob: bool = False
    """Renormalize the top-k probabilities to sum to one."""
    num_groups: int = 1
    """Group-limited routing: the experts form num_groups groups of consecutive ids (num_groups
    = nodes of the EP group: node-limited routing, docs/moe.md); 1 = off."""
    group_topk: int = 1
    """With num_groups > 1: the groups a token may route to (by the sum of each group's two best scores)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' combine weights (DeepSeek-V3: 2.5)."""
    load_balance: Literal["aux_loss", "seq_aux_loss", "aux_free", "none"] = "aux_loss"
    """"aux_loss": a balance loss over the micro-batch's tokens, times aux_loss_coeff; "seq_aux_loss":
    the same per sequence, averaged; "aux_free": a bias per expert added to the scores for the
    choice only, moved toward the mean load after each optimizer step; "none"."""
    shared_expert_overlap: bool = True
    """Run the shared expert while the routed tokens' all-to-all is in flight (default true)."""
    aux_loss_coeff: float = 1e-2
    """The balance loss's weight (load_balance = "aux_loss" or "seq_aux_loss")."""
    z_loss_coeff: float = 0.0
    """The router z-loss's weight: the mean over tokens of logsumexp(logits)^2; 0 = off."""
    expert_kernels: ExpertKernels = "auto"
    """The routed experts' grouped GEMMs (docs/moe.md, "What each option costs"): "torch"
    (torch._grouped_mm); "quack" (QuACK's kernels on sm90+ GPUs, the rows' gather fused:
    `pip install -e ".[quack]"`); "fp8" (forward and input-gradient GEMMs in float8_e4m3fn with one
    fp32 scale per row, weight gradients in bf16, on torch's kernels: sm90+ GPUs, bf16 compute;
    docs/benchmarks.md says at which shapes it pays); "auto" (default): QuACK where it is installed
    and the GPU, dtype and rows suit it, else torch; never "fp8"."""
    ep_overlap: EpOverlap = "off"
    """What runs under the expert all-to-alls (needs expert_parallel_degree > 1; docs/moe.md, "What
    each option costs"): "off"; "wgrad": the routed experts' weight gradients computed apart from
    their input gradients, in backward while the dispatch all-to-all's gradients travel
    (Megatron-Core's --delay-wgrad-compute); "batch": two micro-batches interleaved layer by layer,
    one's forward beside the other's backward, so that each one's all-to-alls run under the other's
    compute (Megatron-Core's --overlap-moe-expert-parallel-comm; needs >= 2 micro-batches, under
    pipeline parallelism the pairs of the 1F1B / Interleaved1F1B steady state); "batch_wgrad":
    "batch" with the weight gradients split, filling the slot after the other's dispatch. Each is
    measured slower than "off" on the 2-GPU runs."""
    exchange: Literal["auto", "exact", "static", "device"] = "auto"
    """The routed tokens' exchange over expert_parallel_degree x expert_tensor_parallel_degree
    (docs/moe.md, "Exchanges"): "exact" moves the real rows and reads the split sizes on the host
    before each all-to-all; "static" (dropless only) sends each ep peer a block of the most rows it
    could get, T * min(top_k, experts per ep rank), with the sizes on the device (ep x the bytes;
    what compile.cudagraphs needs with ep or etp > 1); "device" (dropless, ep only) moves the real
    rows with the sizes on the device (NVSHMEM all-to-all on GPUs; a host stand-in elsewhere), into
    buffers of the most rows a rank can get; "auto" picks "exact": "static" and "device" are measured
    slower than it on the 2-GPU runs (docs/moe.md, "What each option costs"). No effect with ep = etp = 1."""
    hot_expert_replicas: int = 0
    """Copies of hot experts: every ep rank runs a copy of the layer call's R busiest experts, whose
    rows a planner on the device spreads over the ep ranks (docs/moe.md); 0 = off. Copies are not
    parameters: never in the optimizer or a checkpoint. Dropless with the exact exchange only."""
    stash_rows: int = 0
    """With exchange = "static": the tensors the routed experts save for backward keep only their
    real rows, packed into one pool of this many rows per saved tensor, shared by the MoE layers
    (paged stashing, docs/moe.md): at least the real rows an ep rank's experts get in all the
    layers in flight. A step that needs more stops before its optimizer step with one line; 0 = off.
    Not with activation checkpointing nor compile.cudagraphs; under torch.compile the experts run in
    eager mode between the layer's graphs (the stash hooks autograd's saved tensors)."""
    routing_replay: Literal["off", "rollout", "recorded"] = "off"
    """Routing replay for RL (docs/rl.md, "Routing replay"): "off", the router chooses the experts;
    "rollout" (R3), each MoE layer takes the experts the inference engine chose, the batch's
    routed_experts (training.dataset_format = "rollouts"); "recorded" (R2), a no-grad forward of the
    current weights over the micro-batch records the routing and the training forward (and its
    recompute) replays it. The router still computes its scores: the combine weights are the scores
    at the replayed experts, normalised and scaled as configured, and the balance statistics, aux
    losses, aux-free bias and metrics.expert_load count the replayed experts."""


# keys of the job alone (speed, exchange, replay), which no flavor sets: the section keeps the
# layer's default, which the rules (common/rules.py) read. Every other key of MoEKeys is unset
# in the section (None) until the user sets it: the flavor's value stays, and the rules tell
# unset from set (token_drop unset follows capacity_factor; drop_policy set needs token drop)
JOB_KEYS = ("expert_kernels", "ep_overlap", "exchange", "hot_expert_replicas", "stash_rows", "routing_replay")


@dataclass
class MovedMoEKeys:
    """The `[moe]` keys that moved to another key: common/rules.py's MOVED reads each as its new key."""

    pad_to_capacity: bool | None = None
    """Moved: `pad_to_capacity = true` is `token_drop = "drop_and_pad"` (accepted with a notice)."""
    grouped_gemm: Literal["auto", "torch", "quack"] | None = None
    """Moved: `grouped_gemm = X` is `expert_kernels = X` (accepted with a notice)."""
    expert_fp8: bool = False
    """Moved: `expert_fp8 = true` is `expert_kernels = "fp8"` (accepted with a notice)."""
    delay_wgrad_compute: bool = False
    """Moved: `delay_wgrad_compute = true` is `ep_overlap = "wgrad"` ("batch_wgrad" with the batch
    overlap; accepted with a notice)."""
    overlap_ep_comm: bool = False
    """Moved: `overlap_ep_comm = true` is `ep_overlap = "batch"` ("batch_wgrad" with the split weight
    gradients; accepted with a notice)."""
    static_ep_exchange: bool = False
    """Moved: `static_ep_exchange = true` is `exchange = "static"` (accepted with a notice)."""


def section() -> type:
    """The job config's `[moe]` class: MoEKeys' keys (those not in JOB_KEYS unset: None), then
    MovedMoEKeys'. Its fields' help text is found on the classes it derives from."""
    unset = [(f.name, cast(Any, f.type) | None, None) for f in dataclasses.fields(MoEKeys) if f.name not in JOB_KEYS]
    namespace = {
        "__module__": __name__,
        "__doc__": "Router and capacity settings. Unset (None) keeps the model flavor's value.",
    }
    return dataclasses.make_dataclass("MoE", unset, bases=(MovedMoEKeys, MoEKeys), namespace=namespace)


if TYPE_CHECKING:  # the type checker's view of the derived class

    class MoE(MovedMoEKeys, MoEKeys): ...

else:
    MoE = section()


def _described(cls: type) -> dict[str, str]:
    """Each field of `cls` (its own, not inherited) -> its docstring, read from the source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    text = {}
    for field, doc in itertools.pairwise(body.body):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                text[field.target.id] = inspect.cleandoc(doc.value.value)
    return text


def _toml(value: Any) -> str:
    return "unset" if value is None else json.dumps(value)


def _values(kind: Any) -> str:
    if get_origin(kind) is Literal:
        return " | ".join(map(_toml, get_args(kind)))
    if get_origin(kind) in (Union, types.UnionType):
        return " | ".join(map(_values, get_args(kind)))
    return "unset" if kind is type(None) else kind.__name__


def keys() -> str:
    """The `[moe]` keys with their values, defaults and help text (docs/configuration.md quotes it)."""
    lines = []
    for cls in (MoEKeys, MovedMoEKeys):
        text = _described(cls)
        for f in dataclasses.fields(cls):
            flavor = cls is MoEKeys and f.name not in JOB_KEYS
            default = "unset: the flavor's value" if flavor else f"default {_toml(f.default)}"
            lines += [f"{f.name}: {_values(f.type)}; {default}", *(f"    {line}" for line in text[f.name].splitlines())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(keys())
