"""Routed experts' weight gradients apart from their input gradients (`moe.ep_overlap = "wgrad"` or "batch_wgrad").

The backward of a grouped GEMM y = x @ w[e].T is two GEMMs: dX = dY @ w[e], which the
dispatch all-to-all of the layer's backward waits for, and dW[e] = dY_e^T @ x_e, which
nothing in the layer waits for. With the split on, backward computes dX at once and puts
the dW work into the layer's `WgradQueue`; `flush()` runs it later:

- alone ("wgrad"): in the backward of the layer's dispatch all-to-all, after
  the all-to-all is issued and before its result is read, so that on a GPU the weight
  GEMMs run while the tokens' gradients travel (Megatron-Core's --delay-wgrad-compute);
- in the two-micro-batch schedule ("batch_wgrad", parallel/overlap.py): where the
  schedule puts it, beside the other micro-batch's forward;
- with FSDP2 over the experts (edp > 1): at the experts unit's input in backward, so that
  the unit's reduce-scatter, which runs when the gradients reach that input, sums the
  complete weight gradients. FSDP then gives W no room to move past the dispatch.

Whatever happens, `flush_wgrad(model_parts)` before the gradients are read (clipping, the
optimizer) runs anything still queued. A queued item is a closure over the saved operands
(dY, x): it computes dW and sends it back through the autograd graph of the weight as the
forward used it (its cast, DTensor.to_local), so parameter gradients accumulate as usual.
"""

from collections.abc import Callable

import torch

from titan_fold.compat.ops import grouped_mm, has_grouped_mm, is_fake
from titan_fold.moe.fp8 import _weight_grad, fp8_grouped_linear
from titan_fold.moe.quack import grouped_dgrad as quack_dgrad
from titan_fold.moe.quack import grouped_linear as quack_linear
from titan_fold.moe.quack import weight_grad


class WgradQueue:
    """Deferred weight-gradient work of one MoE layer's experts, run in order by flush().

    flush_in_dispatch: the dispatcher flushes in its all-to-all's backward (the split alone);
    off, the work waits for flush() or flush_wgrad()."""

    def __init__(self):
        self.pending: list[Callable[[], None]] = []
        self.flush_in_dispatch = True

    def defer(self, work: Callable[[], None]) -> None:
        self.pending.append(work)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if pending:
            with torch.profiler.record_function("moe:experts weight gradients"):
                for work in pending:
                    work()

    def __len__(self) -> int:
        return len(self.pending)


def defer_weight_grad(
    queue: WgradQueue,
    w: torch.Tensor,
    grad: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    weight_grad: Callable | None = None,
) -> None:
    """Queue dW = grad^T x per group, sent into w's autograd graph (w is the forward's weight
    operand); weight_grad(grad, x, offs) -> [E, N, K] computes it (default: torch's GEMMs)."""
    if not w.requires_grad:
        return

    def work():
        torch.autograd.backward(w, (weight_grad or _weight_grad_of)(grad, x, offs).to(w.dtype))  # dW [E, N, K]

    queue.defer(work)


def _grouped_ok(x: torch.Tensor, *widths: int) -> bool:
    # bf16 anywhere (CUDA, CPU eager, fake tensors), fp32 in CPU eager; 16-byte aligned rows
    fp32_ok = x.dtype == torch.float32 and not x.is_cuda and not is_fake(x)
    return (
        has_grouped_mm()
        and (x.dtype == torch.bfloat16 or fp32_ok)
        and all((n * x.element_size()) % 16 == 0 for n in widths)
    )


def _weight_grad_of(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grad [M, N], x [M, K] -> [E, N, K], group e: grad[rows of e].T @ x[rows of e]."""
    if grad.is_cuda:
        return _weight_grad(grad, x, offs)
    if _grouped_ok(x, grad.shape[1], x.shape[1]):
        return grouped_mm(grad.t(), x, offs=offs)
    out, start = [], 0
    for end in offs.tolist():
        out.append(grad[start:end].T @ x[start:end])
        start = end
    return torch.stack(out)


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [M, K] rows grouped by offs, w [E, N, K] -> [M, N] (no autograd)."""
    if _grouped_ok(x, x.shape[1], w.shape[1]):
        return grouped_mm(x, w.transpose(1, 2), offs=offs)
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[e].T)
        start = end
    return torch.cat(out)


def _grouped_dgrad(grad: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """_grouped_linear's input gradient: grad [M, N] -> grad @ w[e] per group, [M, K]."""
    return _grouped_linear(grad, w.transpose(1, 2), offs)


class _SplitGroupedLinear(torch.autograd.Function):
    """y = linear(x, w, offs) = x @ w[e].T per group; backward returns dX = dgrad(dY, w, offs)
    and hands (dY, x, offs) to `defer`. linear and dgrad: torch's GEMMs or QuACK's."""

    @staticmethod
    def forward(ctx, x, w, offs, defer, linear, dgrad):
        ctx.save_for_backward(x, w, offs)
        ctx.defer, ctx.dgrad = defer, dgrad
        return linear(x, w, offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        ctx.defer(grad, x, offs)
        return ctx.dgrad(grad, w, offs), None, None, None, None, None  # dX [M, K]


def split_grouped_linear(queue: WgradQueue, fp8: bool = False, quack: bool = False) -> Callable:
    """A `linear(x, w, offs)` for experts._swiglu_grouped whose weight gradient goes to
    `queue`; fp8: moe/fp8.py's (FP8 forward and input gradient); quack: QuACK's grouped GEMMs
    (moe/quack.py), the weight gradient by its varlen-K GEMM.

    The GEMM takes w detached: w's own graph (its cast, DTensor.to_local) is run once, by the
    queued work, and not by the layer's backward (where, given no gradient, a DTensor's
    to_local would still accumulate a zero gradient into the parameter)."""

    def linear(x, w, offs):
        def defer(grad, x_, offs_):
            defer_weight_grad(queue, w, grad, x_, offs_, weight_grad if quack else None)

        if fp8:
            return fp8_grouped_linear(x, w.detach(), offs, defer_wgrad=defer)
        if quack:  # QuACK's offsets: [E + 1], from 0
            offs = torch.nn.functional.pad(offs, (1, 0))
            return _SplitGroupedLinear.apply(x, w.detach(), offs, defer, quack_linear, quack_dgrad)
        return _SplitGroupedLinear.apply(x, w.detach(), offs, defer, _grouped_linear, _grouped_dgrad)

    return linear


class _FlushAtInput(torch.autograd.Function):
    """Identity on x; in backward, flushes the queue before x's gradient leaves (FSDP2 reduces
    a unit's gradients when they reach its inputs)."""

    @staticmethod
    def forward(ctx, x, queue):
        ctx.queue = queue
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.queue.flush()
        return grad, None


def flush_at_input(x: torch.Tensor, queue: WgradQueue) -> torch.Tensor:
    return _FlushAtInput.apply(x, queue)


def wgrad_queues(model_parts) -> list[WgradQueue]:
    """The experts' queues of a module or a list of them, found by type (this module sits below the MoE layer)."""
    parts = model_parts if isinstance(model_parts, (list, tuple)) else [model_parts]
    return [q for part in parts for m in part.modules() if isinstance(q := getattr(m, "wgrad", None), WgradQueue)]


def flush_wgrad(model_parts) -> None:
    """Run every weight gradient still queued: before gradients are clipped or applied."""
    for queue in wgrad_queues(model_parts):
        queue.flush()
