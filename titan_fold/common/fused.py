"""Several elementwise passes as one generated kernel, on CUDA in eager mode.

The SwiGLU (routed experts, shared expert, dense FFN), the MoE layer's sums over k, the rotary
embedding of q and k (with Qwen3's q / k norms) and the Adam step are short chains of
elementwise work over large tensors; run op by op each intermediate goes through memory.
`fused(fn)(...)` runs fn through torch.compile on CUDA, so its intermediates stay in registers;
on the CPU, and inside an enclosing torch.compile (which fuses it there), fn runs as written.
"""

import torch

from titan_fold.compat.distributed import AsyncCollectiveTensor
from titan_fold.compat.ops import maybe_mark_dynamic

_COMPILED: dict = {}


def fused(fn):
    """fn(tensor, ...) compiled once for any size of dim 0 of its tensors (dynamic). fn sets
    its dtypes itself: autocast is off inside, so that a call in forward (under autocast) and
    one in backward (outside it) share one compile. Its tensors are passed detached: it runs
    inside autograd Functions or under no_grad, and a tensor that requires grad and one that
    does not would need two compiles. In-place updates of its inputs reach the callers'
    tensors (detach shares storage). The call itself is kept short: in eager mode the host
    launches these kernels one layer at a time, and a slow launch leaves the GPU waiting."""

    def call(*args):
        if args[0].device.type != "cuda" or torch.compiler.is_compiling():
            return fn(*args)
        compiled = _COMPILED.get(fn)
        if compiled is None:
            compiled = _COMPILED[fn] = torch.compile(fn, fullgraph=True)
        # torch.compile specializes sizes 0 and 1 (a second compile), e.g. an empty FSDP shard
        # in the master step: so few rows run as written
        few_rows, passed = False, []
        for t in args:
            if isinstance(t, torch.Tensor):
                if isinstance(t, AsyncCollectiveTensor):  # in flight: its type would be a second compile
                    t = t.wait()
                t = t.detach()
                if t.dim():
                    few_rows = few_rows or t.shape[0] < 2
                    maybe_mark_dynamic(t, 0)
            passed.append(t)
        run = fn if few_rows else compiled
        if torch.is_autocast_enabled("cuda"):
            with torch.autocast("cuda", enabled=False):
                return run(*passed)
        return run(*passed)

    return call
