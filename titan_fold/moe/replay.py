"""Routing replay (`moe.routing_replay`): the MoE layers take given experts instead of their
routers' choice, so that the trainer routes a token as the policy that sampled it did.

    rollout  (R3)  the batch's routed_experts [b, s, n_moe_layers, k], the inference engine's choice
    recorded (R2)  with record_routing(model_parts, tokens) as rec: model(tokens)   # no grad
                   model(tokens, routed_experts=replay_routing(rec.recorded, tokens))  # later

The router still computes its scores: the combine weights are the scores at the replayed experts,
normalised and scaled as configured, so it still gets gradients; the balance statistics, aux losses,
aux-free bias and metrics.expert_load count the replayed experts (moe/router.py: route).

Data flow. The ids follow the tokens: `shard_routed_experts` splits them as the trainer splits the
batch (cp's two chunks, or packed documents' blocks in cp_order; then sequence parallelism's tp
pieces), the model hands each MoE layer its own column (`MoE.moe_index`, the layer's place among
the main model's MoE layers, so a pipeline stage reads its own layers'; the MTP layers' MoE layers
have none and route by their routers: replayed_layers), and the dispatcher moves
them as any choice: capacity drops after the replay, hot-expert copies map the replayed logical
ids, activation checkpointing's recompute gets the same argument and replays the same ids.
"""

import contextlib
from dataclasses import dataclass

import torch

from titan_fold.moe.layer import MoE, moe_layers

ROUTED_EXPERTS = "routed_experts"  # the batch's key and the model's keyword


def routing_problem(routed: torch.Tensor, tokens: torch.Tensor, n_moe_layers: int, top_k: int) -> str | None:
    """Why routed [b, s, n_moe_layers, top_k] int64 cannot be replayed on tokens [b, s]; None if it can."""
    want = (*tokens.shape[:2], n_moe_layers, top_k)
    if routed.dtype != torch.int64 or tuple(routed.shape) != want:
        return (
            f"routed_experts: {routed.dtype} {tuple(routed.shape)} where the batch and model need int64 "
            f"{want} (batch, tokens, MoE layers, top_k)"
        )
    return None


def shard_routed_experts(routed: torch.Tensor, cp_index: torch.Tensor | None, tp: int, tp_rank: int) -> torch.Tensor:
    """The batch's routed [b, s, L, k] -> the ids of the tokens this rank's MoE layers hold
    [b, s / (cp * tp), L, k], split as the tokens are: cp_index the cp rank's token indices, [s / cp]
    (the load-balanced two chunks, attention.cp_shard's positions) or [b, s / cp] (packed
    documents, this rank's part of cp_order); then sequence parallelism's contiguous tp pieces."""
    if cp_index is not None and cp_index.dim() == 1:
        routed = routed.index_select(1, cp_index)
    elif cp_index is not None:
        b, n = cp_index.shape
        routed = routed.gather(1, cp_index.view(b, n, 1, 1).expand(b, n, *routed.shape[2:]))
    return routed.chunk(tp, dim=1)[tp_rank] if tp > 1 else routed


@dataclass
class RecordedRouting:
    """A forward's routing: routed_experts [b, s', n_moe_layers, k] (s' the tokens the MoE layers
    held; the columns of layers this rank does not hold are 0 .. k-1) and the forward's input tokens
    [b, s], which replay_routing checks."""

    routed_experts: torch.Tensor
    tokens: torch.Tensor


@dataclass
class Recording:
    """What record_routing yields; `recorded` is set when the block exits."""

    tokens: torch.Tensor
    recorded: RecordedRouting | None = None


def replayed_layers(model_parts) -> list[MoE]:
    """The MoE layers routing replay covers, those with a column in routed_experts: the main
    model's. An MTP layer's (moe_index None) routes by its router in every mode: no engine returns
    its routing, and R2 neither records nor replays it."""
    return [moe for moe in moe_layers(model_parts) if moe.moe_index is not None]


@contextlib.contextmanager
def record_routing(model_parts, tokens: torch.Tensor):
    """Record the experts each MoE layer of model_parts chooses in the forward run inside the block
    (one forward, or a pipeline schedule's forward-only pass over the micro-batches), on tokens
    [b, s] (the forward's input), without gradient and in eager mode (the layers
    append their choice to a list, which a compiled graph would break on): the R2 record pass.
    Nothing is counted in the layers' statistics or expert load."""
    layers = replayed_layers(model_parts)
    for moe in layers:
        moe.recorded = []
    recording = Recording(tokens)
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            yield recording
        recording.recorded = _assemble(layers, tokens)
    finally:
        for moe in layers:
            moe.recorded = None


def _assemble(layers: list[MoE], tokens: torch.Tensor) -> RecordedRouting:
    """Each layer's calls, one per micro-batch in order (a pipeline schedule's, or one forward), put
    back together along the batch: -> routed_experts [b, s', n_moe_layers, k]."""
    calls = [len(moe.recorded or []) for moe in layers]
    if not layers or len(set(calls)) != 1 or calls[0] == 0:
        raise ValueError(f"record_routing: every MoE layer must run as often; they ran {calls} times")
    per_layer = [torch.cat(moe.recorded or [], 0) for moe in layers]  # [b, s', k] each
    b, s, k = per_layer[0].shape
    # the layers this rank does not hold: valid, distinct ids, never read
    routed = torch.arange(k, device=per_layer[0].device).expand(b, s, layers[0].n_moe_layers, k).clone()
    for moe, ids in zip(layers, per_layer, strict=True):
        routed[:, :, moe.moe_index] = ids
    return RecordedRouting(routed, tokens.detach().clone())


def replay_routing(recorded: RecordedRouting, tokens: torch.Tensor) -> torch.Tensor:
    """The model's routed_experts to replay `recorded` on a forward over tokens [b, s], which must
    be the recorded forward's tokens (checked: ids recorded for another batch are refused)."""
    if recorded.tokens.shape != tokens.shape or not torch.equal(recorded.tokens, tokens):
        raise ValueError(
            f"replay_routing: the routing was recorded on other tokens ({tuple(recorded.tokens.shape)}) "
            f"than this forward's ({tuple(tokens.shape)}); record this batch first"
        )
    return recorded.routed_experts
