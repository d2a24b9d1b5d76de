"""The policy objective (training.objective = "policy"): a token-level clipped policy-gradient
loss on rollouts (docs/rl.md, "The policy objective").

For each labelled token t (the rollout's loss_mask, within its document), with logp_t the
trainer's log-probability of the token, b_t the behaviour policy's (the record's logprobs) and
A_t its advantage:

    policy_tis_cap = 0:   r_t = exp(logp_t - b_t),        w_t = 1
    policy_tis_cap > 0:   r_t = exp(logp_t - sg(logp_t)),   w_t = min(exp(sg(logp_t) - b_t), tis_cap)
    term_t = -min(r_t * A_t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_t)
    loss   = sum_t w_t * term_t / (labelled tokens of the global batch)

sg: no gradient. Without truncated importance sampling the clipped ratio is against the
behaviour policy (the engine's). With it, the ratio is against the trainer's own policy before
the step's update (the trainer takes one optimizer step per batch, so that is sg(logp_t)), and
the mismatch between trainer and engine is corrected by the trainer / behaviour probability
ratio, capped at tis_cap (truncated importance sampling, as verl's and slime's TIS). The sum is this function's; the trainer divides it by the global token count
as it does the language-model loss (trainer/step.py), so packing, micro-batches and dp do not
change the loss. No reference model enters it. With MTP layers (mtp.num_layers) their
language-model loss on the same labelled tokens enters backward beside it, scaled as in
pre-training (models/mtp.py); it reads the labels only, not b_t or A_t.

The per-token inputs travel in the loss's target, one float tensor [b, s, 3] (policy_target):
the label id, b_t and A_t. cp shards it and the pipeline schedule splits it as the labels, and
only the stage that computes the loss reads it.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX

from titan_fold.common.config import JobConfig

# the target's channels
LABEL, BEHAVIOUR_LOGPROB, ADVANTAGE = 0, 1, 2


def policy_target(labels: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """labels [b, s] int64, behaviour_logprobs, advantages [b, s] -> the loss's target [b, s, 3]
    float32 (label ids are exact in float32 below 2**24)."""
    return torch.stack([labels.float(), behaviour_logprobs.float(), advantages.float()], dim=-1)


# PolicyStats' sums, in order; the largest ratio is kept apart
STAT_SUMS = ("ratio", "clipped", "logprob_gap", "kl_k3", "tokens")


class PolicyStats:
    """Sums over the labelled tokens of a step (reset at its start), on the device: the ratio,
    the tokens whose gradient the clip stops, |logp - b|, the k3 estimate exp(b - logp) - (b -
    logp) - 1, the token count; and the largest ratio."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # [len(STAT_SUMS)] float32
        self.max_ratio: torch.Tensor | None = None  # []

    def reset(self) -> None:
        self.sums = self.max_ratio = None

    @torch.no_grad()
    def add(self, mask: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, log_ratio: torch.Tensor) -> None:
        """Tensors [b, s]: mask (labelled), ratio r, clipped (bool), log_ratio logp - b."""
        m = mask.float()
        sums = torch.stack(
            [
                (ratio * m).sum(),
                (clipped.float() * m).sum(),
                (log_ratio.abs() * m).sum(),
                ((torch.exp(-log_ratio) + log_ratio - 1) * m).sum(),
                m.sum(),
            ]
        )
        top = (ratio * m).amax() if ratio.numel() else torch.zeros((), device=ratio.device)
        self.sums = sums if self.sums is None else self.sums + sums
        self.max_ratio = top if self.max_ratio is None else torch.maximum(self.max_ratio, top)

    def values(self) -> torch.Tensor | None:
        """[len(STAT_SUMS) + 1]: the sums, then the largest ratio; None before any token."""
        if self.sums is None or self.max_ratio is None:
            return None
        return torch.cat([self.sums, self.max_ratio[None]])


class PolicyLoss:
    """loss_fn(pred [b, s, vocab], target [b, s, 3]) -> the policy loss summed over the
    labelled tokens (module docstring); its statistics go to `stats`."""

    def __init__(self, clip_low: float, clip_high: float, tis_cap: float = 0.0):
        self.clip_low, self.clip_high, self.tis_cap = clip_low, clip_high, tis_cap
        self.stats = PolicyStats()

    def __call__(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels = target[..., LABEL].long()  # [b, s]
        mask = labels != IGNORE_INDEX
        nll = F.cross_entropy(
            pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX
        )
        if isinstance(nll, DTensor):  # loss parallel under tp: every tp rank holds every token's
            nll = nll.full_tensor()
        logp = -nll.view_as(labels)  # [b, s]
        # 0 where unlabelled: exp stays finite whatever the padding holds
        log_ratio = torch.where(mask, logp - target[..., BEHAVIOUR_LOGPROB], 0.0)
        advantage = target[..., ADVANTAGE]
        ratio = torch.exp(log_ratio)  # trainer / behaviour
        # with TIS the clipped ratio is against the trainer's own policy before this step's update
        # (logp detached: one optimizer step per batch), and the capped trainer / behaviour weight
        # corrects the mismatch; without it, against the behaviour policy
        policy_ratio = torch.exp(logp - logp.detach()) if self.tis_cap > 0 else ratio
        unclipped = policy_ratio * advantage
        clipped = torch.clamp(policy_ratio, 1 - self.clip_low, 1 + self.clip_high) * advantage
        term = -torch.minimum(unclipped, clipped)
        if self.tis_cap > 0:
            term = term * torch.clamp(torch.exp(log_ratio.detach()), max=self.tis_cap)
        self.stats.add(mask, ratio.detach(), clipped.detach() < unclipped.detach(), log_ratio.detach())
        return torch.where(mask, term, 0.0).sum()


def build_loss(job_config: JobConfig, **kwargs: Any) -> Callable[..., torch.Tensor]:
    """TrainSpec.build_loss_fn: the policy loss for training.objective = "policy", else
    torchtitan's cross-entropy (summed; the trainer divides by the global token count)."""
    from torchtitan.components.loss import build_cross_entropy_loss

    tr = job_config.training
    if getattr(tr, "objective", "lm") == "policy":
        return PolicyLoss(tr.policy_clip_low, tr.policy_clip_high, tr.policy_tis_cap)
    return build_cross_entropy_loss(job_config, **kwargs)


def policy_metrics(values: list[float]) -> dict[str, float | None]:
    """PolicyStats.values summed over the ranks (the largest ratio: its max) -> the logged metrics,
    means over the labelled tokens of the step."""
    sums = dict(zip(STAT_SUMS, values, strict=False))
    n = sums["tokens"]
    mean = (lambda key: sums[key] / n) if n else (lambda key: None)
    return {
        "policy_ratio_mean": mean("ratio"),
        "policy_ratio_max": values[len(STAT_SUMS)] if n else None,
        "policy_clip_frac": mean("clipped"),
        "logprob_gap": mean("logprob_gap"),
        "kl_k3": mean("kl_k3"),
        # moe.routing_replay's share of (token, layer) routings that replay changed goes here
    }
