"""Token cross-entropy summed over the valid labels (torchtitan's `cross_entropy_loss`, and the
Multi-Token Prediction layers' loss), with eager CUDA runs in two generated kernels.

torchtitan's loss casts the logits [tokens, vocab] to float32 and calls F.cross_entropy. Run op by
op, that writes a float32 copy of the logits, log_softmax writes a second one (saved for backward),
and backward writes two more before casting back: about 45 GB of memory traffic at 8192 tokens x
151,936 vocab (the Qwen3 proxies). Here the forward reads the logits once into each token's
logsumexp, and the backward writes the logits' gradient, in their dtype, from the logits and that
logsumexp: the same float32 math, rounded once, in about a sixth of the traffic.

Elsewhere F.cross_entropy runs as before: on the CPU, inside torch.compile (which fuses it there),
and on logits sharded on the vocabulary (DTensor; tensor parallelism's loss_parallel).
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_fold.common.fused import fused

IGNORE_INDEX = -100  # torchtitan's (and torch's default): labels past the end of a sequence


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [..., vocab], labels [...] -> the sum of -log softmax(logits)[label] over the labels
    other than IGNORE_INDEX, float32 []."""
    if logits.device.type != "cuda" or isinstance(logits, DTensor) or torch.compiler.is_compiling():
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return _CrossEntropy.apply(logits.flatten(0, -2), labels.flatten())


def _forward(logits, labels):
    # logits [N, V], labels [N] -> (loss [], logsumexp [N]), float32
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != IGNORE_INDEX
    picked = x.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lse - picked, 0.0).sum(), lse


def _backward(grad, logits, labels, lse):
    # grad [] -> d loss / d logits [N, V] in the logits' dtype: (softmax - one-hot) x grad, zero for ignored labels
    x = logits.float()
    onehot = torch.arange(x.shape[-1], device=x.device) == labels.unsqueeze(-1)
    scale = torch.where(labels != IGNORE_INDEX, grad, 0.0).unsqueeze(-1)
    return ((torch.exp(x - lse.unsqueeze(-1)) - onehot.float()) * scale).to(logits.dtype)


class _CrossEntropy(torch.autograd.Function):
    """token_cross_entropy on [N, V] logits: saves the logits and their logsumexp [N] (float32),
    not a float32 log_softmax [N, V]."""

    @staticmethod
    def forward(ctx, logits, labels):
        loss, lse = fused(_forward)(logits, labels)
        ctx.save_for_backward(logits, labels, lse)
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse = ctx.saved_tensors
        return fused(_backward)(grad, logits, labels, lse), None
