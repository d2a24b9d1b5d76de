"""The EP exchange with its split sizes on the device (`moe.exchange = "device"`).

The exact exchange brings every layer's split sizes to the host before its all-to-all (a
device-to-host copy and a wait); the static one sends each peer a worst-case block. This one
moves only the real rows, and nothing leaves the device: on a GPU with NVSHMEM, symmetric
memory's `all_to_all_vdev` reads the sizes on the device; elsewhere (CPU, gloo, the dry run) a
stand-in with the same contract reads them on the host, so CI tests the code around the op.

One op, `ep_exchange(src, index, send, recv, gather, cap, group_name)`, serves both directions:

    rows    src[index]                     # [sum(send), dim] grouped by destination ep rank
    travel  send[d] rows to ep rank d      # received source after source: V rows, V <= cap
            recv[s] rows from ep rank s    # the counts the dispatcher exchanged (moe/counts.py)
    read    recv[gather]                   # gather [r]: rows; [T, k]: each token's k rows summed
            (row `cap` of recv is zero: a gather index of cap reads a zero row)

The receive side is a buffer of cap + 1 rows, allocated once: the shapes are static, so the
layer compiles as one graph and replays as a CUDA graph. A route (index, send, recv, gather) and its
mirror make an autograd pair: the gradient takes the mirror route back.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from titan_fold.common.fused import fused
from titan_fold.common.tensors import waited
from titan_fold.compat.distributed import funcol, is_nvshmem_available, resolve_process_group, symmetric_memory

Exchange = Literal["auto", "exact", "static", "device"]


def nvshmem_available() -> bool:
    if not torch.cuda.is_available():
        return False
    return is_nvshmem_available()


def resolve(choice: str, ep: int, etp: int) -> str:
    """moe.exchange -> the exchange a layer over ep x etp runs: "auto" is "exact" (the device
    exchange is not measured faster on the configurations lent so far: docs/moe.md)."""
    if ep * etp == 1:
        return "exact"  # no exchange: every variant is the same single-rank code
    return "exact" if choice == "auto" else choice


# ---- symmetric buffers ----------------------------------------------------------------------
# Custom ops take tensors and scalars, not Python objects: the buffers live in one cache per
# process, keyed by (group, dtype, width, cap), like torch's own symmetric-memory workspaces
# (a ring serves one cap: its zero row is row cap).


@dataclass
class _Slot:
    send: torch.Tensor  # [cap * width] symmetric: the rows this rank sends, read by its peers
    recv: torch.Tensor  # [(cap + 1) * width] symmetric: the rows received, then a zero row
    in_splits: torch.Tensor  # [W] symmetric int64: elements sent to each peer
    out_splits_offsets: torch.Tensor  # [2, W] symmetric int64: written by the peers


class _Ring:
    """Two slots used in turn. NVSHMEM's all-to-all reads each peer's send buffer and writes the
    peers' split sizes into this rank's slot; every call starts with a barrier of the group, so a
    slot is free again once the next call has passed it: two are enough."""

    def __init__(self, cap: int, width: int, dtype: torch.dtype, device: torch.device, group_name: str):
        symm_mem = symmetric_memory()
        symm_mem.set_backend("NVSHMEM")
        W = resolve_process_group(group_name).size()
        self.cap, self.width, self.turn = cap, width, 0
        self.slots = []
        for _ in range(2):
            slot = _Slot(
                symm_mem.empty(cap * width, dtype=dtype, device=device),
                symm_mem.empty((cap + 1) * width, dtype=dtype, device=device),
                symm_mem.empty(W, dtype=torch.int64, device=device),
                symm_mem.empty((2, W), dtype=torch.int64, device=device),
            )
            slot.recv.zero_()  # row cap stays zero: the op writes rows below V <= cap only
            for t in (slot.send, slot.recv, slot.in_splits, slot.out_splits_offsets):
                symm_mem.rendezvous(t, group_name)
            self.slots.append(slot)

    def next(self) -> _Slot:
        self.turn ^= 1
        return self.slots[self.turn]


_RINGS: dict[tuple, _Ring] = {}


def _ring(group_name: str, dtype: torch.dtype, width: int, cap: int, device: torch.device) -> _Ring:
    key = (group_name, dtype, width, cap)
    if key not in _RINGS:  # allocated collectively: every rank asks for the same keys in the same order
        _RINGS[key] = _Ring(cap, width, dtype, device, group_name)
    return _RINGS[key]


# ---- the op ---------------------------------------------------------------------------------


def _read(recv: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """recv [cap + 1, dim] -> recv[gather] ([r, dim]) or, gather [T, k], each token's k rows summed."""
    if gather.dim() == 1:
        return recv[gather]
    return fused(_sum_rows)(recv, gather)


def _sum_rows(recv: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    # in float, as the exact exchange's combine sums: the k rows of a token in one kernel
    total = recv[gather[:, 0]].to(torch.promote_types(recv.dtype, torch.float32))
    for j in range(1, gather.shape[1]):
        total = total + recv[gather[:, j]]
    return total.to(recv.dtype)


def _stand_in(rows: torch.Tensor, send: torch.Tensor, got: torch.Tensor, cap: int, group_name: str) -> torch.Tensor:
    """all_to_all_vdev's contract over any backend (CPU, gloo, the dry run), and no host read
    either: rows [m, dim] (send[d] for rank d, in order), got [W] (rows from each source) ->
    recv [cap + 1, dim], the V rows received first (source after source), zeros after. Each peer gets a block of cap rows, its
    rows then zeros (W x cap rows move: a stand-in, not a fast path)."""
    W, m = send.shape[0], rows.shape[0]
    within = torch.arange(cap, device=rows.device)  # [cap]
    start = send.cumsum(0) - send  # [W] first row for each peer
    idx = torch.where(within < send[:, None], start[:, None] + within, m)  # [W, cap]; m = the zero row
    blocks = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])[idx.flatten()]  # [W * cap, dim]
    received = funcol.all_to_all_single(blocks, None, None, group_name)  # [W * cap, dim] by source
    ends = got.cumsum(0)  # [W]
    r = torch.arange(cap + 1, device=rows.device)  # [cap + 1]
    source = torch.searchsorted(ends, r, right=True).clamp(max=W - 1)  # [cap + 1]
    at = source * cap + (r - (ends - got)[source]).clamp(0, cap - 1)
    return torch.where((r < ends[-1])[:, None], waited(received)[at], 0)


@torch.library.custom_op("titan_fold::ep_exchange", mutates_args=())
def ep_exchange(
    src: torch.Tensor,
    index: torch.Tensor,
    send: torch.Tensor,
    recv: torch.Tensor,
    gather: torch.Tensor,
    cap: int,
    group_name: str,
) -> torch.Tensor:
    """src [n, dim], index [m] (rows to send, grouped by destination), send [W] (rows to each ep
    rank, sum <= m), recv [W] (rows from each ep rank; all_to_all_vdev learns them itself) ->
    recv[gather] (see the module docstring)."""
    width = src.shape[1]
    if src.is_cuda and nvshmem_available():
        slot = _ring(group_name, src.dtype, width, cap, src.device).next()
        m = index.shape[0]
        torch.index_select(src, 0, index, out=slot.send[: m * width].view(m, width))
        slot.in_splits.copy_(send * width)
        torch.ops.symm_mem.all_to_all_vdev(slot.send, slot.recv, slot.in_splits, slot.out_splits_offsets, group_name)
        return _read(slot.recv.view(cap + 1, width), gather)
    return _read(_stand_in(src[index], waited(send), waited(recv), cap, group_name), gather)


@ep_exchange.register_fake
def _(src, index, send, recv, gather, cap, group_name):
    rows = gather.shape[0]
    return src.new_empty(rows, src.shape[1])


@dataclass
class Route:
    """One direction of the exchange: which rows leave (index), how many to each ep rank (send,
    on the device), and which received rows form the result (gather)."""

    index: torch.Tensor  # [m]
    send: torch.Tensor  # [ep]
    recv: torch.Tensor  # [ep] rows from each ep rank
    gather: torch.Tensor  # [r] or [T, k]


class _Exchange(torch.autograd.Function):
    """src -> ep_exchange over one route; the gradient returns over the mirror route, which sends
    what this one receives and receives what it sends. Tensors are passed one by one and each
    once (torch.compile traces the function and refuses a tensor given twice)."""

    @staticmethod
    def forward(ctx, src, index, send, recv, gather, back_index, back_gather, cap: int, group_name: str):
        ctx.save_for_backward(back_index, recv, send, back_gather)
        ctx.cap, ctx.group_name = cap, group_name
        return ep_exchange(src, index, send, recv, gather, cap, group_name)

    @staticmethod
    def backward(ctx, grad):
        back_index, back_send, back_recv, back_gather = ctx.saved_tensors
        grad_src = ep_exchange(
            grad.contiguous(), back_index, back_send, back_recv, back_gather, ctx.cap, ctx.group_name
        )
        return (grad_src,) + (None,) * 8


def exchange(src: torch.Tensor, there: Route, back: Route, cap: int, group_name: str) -> torch.Tensor:
    """src [n, dim] or [n] -> the rows `there` reads ([r, dim] or [r]); the gradient goes `back`,
    the mirror route (its send and recv are there's recv and send). cap: the most rows either
    direction receives."""
    flat = src.dim() == 1
    out = _Exchange.apply(
        src[:, None] if flat else src,
        there.index,
        there.send,
        there.recv,
        there.gather,
        back.index,
        back.gather,
        cap,
        group_name,
    )
    return out[:, 0] if flat else out
