"""Several elementwise passes as one generated kernel, on CUDA in eager mode.

The SwiGLU (routed experts, shared expert, dense FFN), the MoE layer's sums over k, the rotary
embedding of q and k (with Qwen3's q / k norms) and the Adam step are short chains of
elementwise work over large tensors; run op by op each intermediate goes through memory.
`fused(fn)(...)` runs fn through torch.compile on CUDA, so its intermediates stay in registers;
on the CPU, and inside an enclosing torch.compile (which fuses it there), fn runs as written.
"""

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

_COMPILED = {}


def fused(fn):
    """fn(tensor, ...) compiled once for any size of dim 0 of its tensors (dynamic). fn sets
    its dtypes itself: autocast is off inside, so that a call in forward (under autocast) and
    one in backward (outside it) share one compile. Its tensors are passed detached: it runs
    inside autograd Functions or under no_grad, and a tensor that requires grad and one that
    does not would need two compiles. In-place updates of its inputs reach the callers'
    tensors (detach shares storage)."""

    def call(*args):
        if args[0].device.type != "cuda" or torch.compiler.is_compiling():
            return fn(*args)
        if fn not in _COMPILED:
            _COMPILED[fn] = torch.compile(fn, fullgraph=True)
        # a collective's output still in flight (AsyncCollectiveTensor) is waited for here: its
        # type would be a second compile
        args = [t.wait() if isinstance(t, AsyncCollectiveTensor) else t for t in args]
        args = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
        sized = [t for t in args if isinstance(t, torch.Tensor) and t.dim() > 0]
        with torch.autocast("cuda", enabled=False):
            if any(t.shape[0] < 2 for t in sized):
                # torch.compile specializes sizes 0 and 1 (a second compile), e.g. an empty
                # FSDP shard in the master step: so few rows run as written
                return fn(*args)
            for t in sized:
                torch._dynamo.maybe_mark_dynamic(t, 0)
            return _COMPILED[fn](*args)

    return call
