"""Multi-Token Prediction (DeepSeek-V3; Megatron-Core's --mtp-num-layers): extra blocks
after the last layer, the k-th predicting the token k + 1 positions ahead.

    layer k (1-based), input h = the main model's last hidden state (k = 1) or layer k-1's:
        h = eh_proj([enorm(embed(t_{i+k})) ; hnorm(h)])     [b, s, 2 dim] -> [b, s, dim]
        h = block(h)                                         one transformer block (MoE or dense,
                                                              as layer n_layers + k - 1 would be)
        logits = output(norm(h)), target t_{i+k+1} where it is trained (future_tokens)

The embedding and the output head are the main model's (shared, passed in). The targets are
the tokens the main loss counts (its labels: under the policy objective the rollouts' response
tokens), the inputs every token. The loss of layer k is its cross-entropy sum over valid targets
times `loss_scale` (1 / the step's global token count, set by the trainer, as for the main loss)
times mtp_loss_scaling_factor / mtp_layers; the model adds it to backward. The blocks' MoE layers
route by their own routers: routing replay's ids cover the main model's MoE layers only (they
have no column in routed_experts, moe/replay.py). `stats` keeps (sum of the per-layer mean losses,
calls) for the `mtp_loss` metric (mtp_stats_values, mtp_stats_from).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_fold.models.layers import trunc_normal_

IGNORE_INDEX = -100  # torchtitan's, for labels past the end of a sequence
FUTURE_TOKENS = "future_tokens"  # the model's keyword for the MTP layers' tokens (future_tokens())


class MTPLayer(nn.Module):
    def __init__(self, layer_id: int, args, block: Callable[[int, Any], nn.Module]):
        super().__init__()
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = block(layer_id, args)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.loss = TokenCrossEntropy()


class TokenCrossEntropy(nn.Module):
    """Cross-entropy sum over the valid targets, as a module: under loss parallelism the logits
    arrive sharded on the vocabulary and the placement plan turns the result into a plain tensor."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits [b, s, vocab], targets [b, s]
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )


class MultiTokenPrediction(nn.Module):
    def __init__(self, args, block: Callable[[int, Any], nn.Module]):
        """block(layer_id, args): the model's transformer block."""
        super().__init__()
        self.args = args
        self.layers = nn.ModuleDict({str(k): MTPLayer(args.n_layers + k, args, block) for k in range(args.mtp_layers)})
        self.register_buffer("loss_scale", torch.ones(()), persistent=False)
        self.register_buffer("stats", torch.zeros(2), persistent=False)

    def forward(
        self,
        h: torch.Tensor,
        future_tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        embed: nn.Module,
        head: nn.Module,
    ) -> torch.Tensor:
        """h [b, s, dim]: the main model's last hidden state (before its final norm);
        future_tokens [b, s, mtp_layers, 2]: each layer's input token and target (future_tokens()).
        Returns the scaled loss (a scalar with gradient)."""
        total = torch.zeros((), device=h.device)
        means = []
        for k, layer in enumerate(self.layers.values()):
            inputs, targets = future_tokens[..., k, 0], future_tokens[..., k, 1]  # [b, s]
            e = embed(inputs.clamp(min=0))  # past the end: any token, its positions have no target
            h = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], dim=-1))
            h = layer.block(h, cos, sin)
            loss = layer.loss(head(layer.norm(h)), targets)
            total = total + loss
            means.append(loss.detach() / (targets != IGNORE_INDEX).sum().clamp(min=1))
        self._record(torch.stack(means).mean())
        return total * (self.loss_scale * self.args.mtp_loss_scaling_factor / len(self.layers))

    @torch.no_grad()
    def _record(self, mean_loss: torch.Tensor) -> None:
        self.stats.add_(torch.stack([mean_loss.float(), torch.ones((), device=self.stats.device)]))

    def init_weights(self, init_std: float):
        for layer in self.layers.values():
            for norm in (layer.enorm, layer.hnorm, layer.norm):
                norm.reset_parameters()
            trunc_normal_(layer.eh_proj.weight, init_std)
            layer.block.init_weights(init_std)
        self.loss_scale.fill_(1.0)
        self.stats.zero_()


def future_tokens(inputs: torch.Tensor, labels: torch.Tensor, mtp_layers: int) -> torch.Tensor:
    """inputs [b, s] and their labels [b, s] (the next token where it is trained, else IGNORE_INDEX)
    -> [b, s, mtp_layers, 2]: MTP layer k's (input, target) at each position, k from 0:

        [..., k, 0]  the token k + 1 positions after the input, trained or not (a response's
                     MTP layers see its prompt as the main model does)
        [..., k, 1]  the label k + 1 positions after: the token k + 2 after where it is trained

    IGNORE_INDEX past the end of the sequence. Without masked labels, [..., k, 0] is [..., k - 1, 1]."""
    ahead = torch.cat([inputs[:, 1:], labels[:, -1:]], dim=1)  # [b, s] the next token (the last: its label)

    def shifted(x: torch.Tensor, j: int) -> torch.Tensor:  # x[:, i + j] at i, IGNORE_INDEX past the end
        return torch.cat([x[:, j:], torch.full_like(x[:, :j], IGNORE_INDEX)], dim=1)

    layers = [torch.stack([shifted(ahead, k), shifted(labels, k + 1)], dim=-1) for k in range(mtp_layers)]
    return torch.stack(layers, dim=2)


def without_mtp(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model's keywords less the MTP layers' tokens: a pass that reads only the main model
    (routing replay's record pass, the Python API's log-probs) does not run the MTP layers, so
    their loss and statistics are counted once per step."""
    return {k: v for k, v in kwargs.items() if k != FUTURE_TOKENS}


def mtp_modules(model_parts) -> list[MultiTokenPrediction]:
    parts = model_parts if isinstance(model_parts, (list, tuple)) else [model_parts]
    return [m for part in parts for m in part.modules() if isinstance(m, MultiTokenPrediction)]


@torch.no_grad()
def mtp_stats_values(model_parts) -> torch.Tensor | None:
    """The MTP layers' statistics since the last call, then reset, as one tensor on their device
    (no host sync): [2] = their cross-entropy sums and calls, summed. None without MTP layers."""
    modules = mtp_modules(model_parts)
    if not modules:
        return None
    total = torch.stack([m.stats for m in modules]).sum(0)
    for m in modules:
        m.stats.zero_()
    return total


def mtp_stats_from(values: torch.Tensor | None) -> dict:
    """mtp_stats_values' tensor read on the host: {"mtp_loss": mean per-layer cross-entropy}, {}
    where no MTP layer ran."""
    if values is None:
        return {}
    loss_sum, calls = values.tolist()
    return {"mtp_loss": loss_sum / calls} if calls > 0 else {}
