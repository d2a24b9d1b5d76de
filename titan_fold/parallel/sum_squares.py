"""The sum of squares of many large CUDA tensors in one Triton launch, for the gradient norm.

One torch.linalg.vector_norm per gradient is one launch per gradient, below the memory's rate;
this kernel reads them near it (the rates: bench/grad_norm.py's record). One launch covers every tensor of a dtype:
each program sums the squares of CHUNK consecutive elements of one tensor in float32 (16-byte
loads) into one partial, and finds its tensor by a binary search of the tensors' first
programs. Short programs read faster than long ones (bench/grad_norm.py records the rates
per CHUNK). The tensors are addressed as element offsets from the
first one's pointer, so the kernel reads them where they are. The caller sums the partials in
a fixed order: the result is the same in every run.

partials(tensors) -> float32 [programs]: every program's partial, tensors in order.
"""

import torch
import triton
import triton.language as tl

from titan_fold.common.tensors import to_device

BLOCK = 2048  # elements per load step (8 warps: one 16-byte load of bf16 a thread)
CHUNK = 16384  # elements per program


@triton.jit
def _partials_kernel(
    base_ptr, table_ptr, out_ptr, T_PAD: tl.constexpr, LOG2_T: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    firsts = table_ptr + 2 * T_PAD
    t = pid * 0
    for i in tl.static_range(LOG2_T):  # the last tensor whose first program is <= pid
        cand = t + (T_PAD >> (i + 1))
        t = tl.where(tl.load(firsts + cand) <= pid, cand, t)
    offset = tl.load(table_ptr + t)  # its first element, counted from base_ptr
    n = tl.load(table_ptr + T_PAD + t)
    lo = (pid - tl.load(firsts + t)) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for step in tl.static_range(0, CHUNK, BLOCK):
        offs = lo + step + tl.arange(0, BLOCK)
        x = tl.load(base_ptr + offset + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def partials(tensors: list[torch.Tensor]) -> torch.Tensor:
    """tensors: contiguous CUDA tensors of one device and dtype, each data pointer a multiple of
    its element size -> float32 [sum over tensors of ceil(numel / CHUNK)]."""
    base, size = tensors[0], tensors[0].element_size()
    counts = [triton.cdiv(t.numel(), CHUNK) for t in tensors]
    t_pad = triton.next_power_of_2(len(tensors))
    pad = [0] * (t_pad - len(tensors))
    firsts, total = [], 0
    for c in counts:
        firsts.append(total)
        total += c
    # int64 [3, t_pad]: element offsets, element counts, first programs (padding: never found)
    table = torch.tensor(
        [
            *((t.data_ptr() - base.data_ptr()) // size for t in tensors),
            *pad,
            *(t.numel() for t in tensors),
            *pad,
            *firsts,
            *[1 << 62] * len(pad),
        ],
        dtype=torch.int64,
    )
    table = to_device(table, base.device)
    out = torch.empty(total, dtype=torch.float32, device=base.device)
    _partials_kernel[(total,)](
        base, table, out, T_PAD=t_pad, LOG2_T=t_pad.bit_length() - 1, BLOCK=BLOCK, CHUNK=CHUNK, num_warps=8
    )
    return out
