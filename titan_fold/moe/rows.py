"""Row movement whose backward is a gather too, the grouping of assignments by expert and the
ep all-to-all: the pieces the dispatcher and the exchanges (moe/exchange.py) move rows with.

x[idx] differentiates into an atomic (sort-based on CUDA) scatter-add, and index_add is an
atomic scatter-add itself; both are several times slower than a gather. The permutations here
are known in both directions, so forward and backward are gathers (and one sum over the k rows
of each token, accumulated in float; its dtype is pinned, since autocast would otherwise return
float32 and turn the whole residual stream float32). On a GPU the gather and the sum over k are
one kernel (fused): the [T*k, dim] gathered rows never reach memory.
"""

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_fold.common.fused import fused
from titan_fold.common.tensors import cast, waited
from titan_fold.compat.distributed import funcol


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter(0, perm, torch.arange(perm.numel(), device=perm.device))


class _PermuteRows(torch.autograd.Function):
    """x[perm] for a permutation perm, inv = its inverse."""

    @staticmethod
    def forward(ctx, x, perm, inv):
        ctx.save_for_backward(inv)
        return x[perm]

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        return grad[inv], None, None


def _sum_by_token(rows: torch.Tensor, slot: torch.Tensor, k: int, dropped: bool) -> torch.Tensor:
    """rows [R, dim], slot [T*k]: the row of each assignment -> [T, dim].

    dropped: some assignments have no row (slot R); they read an appended zero row.
    k gathers of [T, dim] added up in float: fused, one pointwise kernel reads each token's
    k rows, coalesced along dim (a gather of [T*k, dim] then a sum over k, fused as a
    reduction over k, ran at a quarter of the memory bandwidth)."""
    if dropped:
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
    slot = slot.view(-1, k)  # [T, k]
    total = cast(rows[slot[:, 0]], torch.promote_types(rows.dtype, torch.float32))
    for j in range(1, k):
        total = total + rows[slot[:, j]]
    return cast(total, rows.dtype)


SumByToken = Callable[[torch.Tensor, torch.Tensor, int, bool], torch.Tensor]  # _sum_by_token's signature


def _sum_rows(rows: torch.Tensor, slot: torch.Tensor, k: int) -> torch.Tensor:
    # no dropped rows: the backward of a gather fused into the experts, and the device exchange's read
    return fused(_sum_by_token)(rows, slot, k, False)


def _fixed_rows(slot: torch.Tensor, R: int, weights: torch.Tensor, k: int):
    """slot [N]: each assignment's row among R fixed rows (R: dropped, no row) -> (token_of_row [R],
    weight_of_row [R]). Empty rows point at assignment N: token 0 with weight 0, so they add nothing."""
    N = slot.numel()
    assign = torch.full((R + 1,), N, dtype=torch.int64, device=slot.device)
    assign = assign.scatter(0, slot, torch.arange(N, device=slot.device))[:R]  # [R]
    token_of_row = torch.where(assign < N, assign // k, 0)
    weight_of_row = torch.cat([weights, weights.new_zeros(1)])[assign]
    return token_of_row, weight_of_row


class _Dispatch(torch.autograd.Function):
    """x [T, dim] -> rows [R, dim] = x[token_of_row]; backward sums each token's rows.
    total: the sum over k (bench/row_movement.py passes its alternatives)."""

    @staticmethod
    def forward(ctx, x, token_of_row, slot, k, dropped, total: SumByToken = _sum_by_token):
        ctx.save_for_backward(slot)
        ctx.k, ctx.dropped, ctx.total = k, dropped, total
        return x[token_of_row]

    @staticmethod
    def backward(ctx, grad):
        (slot,) = ctx.saved_tensors
        return fused(ctx.total)(grad, slot, ctx.k, ctx.dropped), None, None, None, None, None


class _Combine(torch.autograd.Function):
    """rows [R, dim] -> y [T, dim], each token the sum of its rows; the adjoint of _Dispatch."""

    @staticmethod
    def forward(ctx, rows, token_of_row, slot, k, dropped, total: SumByToken = _sum_by_token):
        ctx.save_for_backward(token_of_row)
        return fused(total)(rows, slot, k, dropped)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return grad[token_of_row], None, None, None, None, None


def _by_expert(blocks: torch.Tensor, rows: int, zero_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [S, E_loc]: rows that arrived from each source for each local expert, source after
    source and by expert within a source, in a buffer of `rows` rows (padding after the real ones)
    -> (perm [rows]: the arrival row of each position grouped by local expert, sources in order
    within an expert, padding last reading `zero_row`; inv [rows]: each arrival row's position)."""
    S, E_loc = blocks.shape
    ends = blocks.flatten().cumsum(0)  # [S * E_loc]
    chunk = torch.searchsorted(ends, torch.arange(rows, device=blocks.device), right=True)  # [rows]
    expert_of_row = torch.where(chunk < S * E_loc, chunk % E_loc, E_loc)  # E_loc = padding
    perm = torch.sort(expert_of_row, stable=True).indices  # [rows] grouped position -> arrival row
    return torch.where(perm < ends[-1], perm, zero_row), _inverse(perm)


def group_by(key: torch.Tensor, num_groups: int, positions: bool = True):
    """key [N] int64 in [0, num_groups) -> (order [N], counts [num_groups], pos [N], or None
    without positions: in eager mode each op costs the host a launch).

    order lists the items grouped by key, stable (original order within a group);
    pos[i] is item i's position inside its group.
    """
    n = key.numel()
    # sorted as the narrowest integers that hold every group: a radix sort takes a pass per key
    # byte (bench/routing.py times it); stable: same order
    narrow = next((t for t in (torch.uint8, torch.int16, torch.int32) if num_groups <= torch.iinfo(t).max), key.dtype)
    sorted_key, order = torch.sort(key.to(narrow), stable=True)
    # group boundaries by binary search in the sorted keys: a counting index_add of int64 becomes
    # a sort-based index_put under torch.compile
    bounds = torch.searchsorted(sorted_key, torch.arange(num_groups + 1, device=key.device, dtype=narrow))  # [G + 1]
    counts, starts = bounds.diff(), bounds[:-1]
    if not positions:
        return order, counts, None
    rank_in_group = torch.arange(n, device=key.device) - starts[sorted_key.long()]
    pos = torch.empty_like(key).scatter(0, order, rank_in_group)
    return order, counts, pos


def _a2a(x: torch.Tensor, out_splits, in_splits, mesh: DeviceMesh | None, then: Callable | None = None) -> torch.Tensor:
    """then: work run in backward after the reverse all-to-all is issued, before it is waited for."""
    if mesh is None:
        return x
    if then is not None:
        return _AllToAllThen.apply(x, out_splits, in_splits, mesh, then)
    return funcol.all_to_all_single_autograd(x, out_splits, in_splits, mesh)


class _AllToAllThen(torch.autograd.Function):
    """all_to_all_single whose backward runs `then()` while the gradients travel; forward
    waits at first use, as the autograd version does (the shared expert runs meanwhile)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, mesh, then):
        ctx.splits, ctx.mesh, ctx.then = (out_splits, in_splits), mesh, then
        return funcol.all_to_all_single(x, out_splits, in_splits, mesh)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_x = funcol.all_to_all_single(grad.contiguous(), in_splits, out_splits, ctx.mesh)  # issued
        ctx.then()
        return waited(grad_x), None, None, None, None
