"""Hot-expert replicas (`moe.hot_expert_replicas = R`): every ep rank runs a copy of the R busiest
experts of the layer call, and a planner on the device spreads their rows over the ep ranks so
that the most loaded rank carries as few rows as it can. No host sync: the plan is tensors.

- The router keeps logical expert ids. From every source's counts (gathered over ep x etp, the
  same table on every rank of the block) the planner nominates the R experts with the most rows
  and water-fills their rows over the ep ranks, on top of each rank's other rows.
- Physical experts: ep rank d runs P_loc = E_loc + R of them, its E_loc home experts, then one
  copy slot per nominee. The dispatcher routes physical ids, so the exchange below it is the
  exact one, unchanged; a copy slot on a nominee's home rank stays empty (its rows go home).
- A copy's weights are a sum over ep of one term, the home rank's (`copies_of`): copies are
  activations, never parameters, so they are never in the optimizer or a checkpoint. Backward
  sums the copies' gradients over ep into the home expert's gradient, before the EDP/FSDP
  reduction of that gradient; with etp > 1 each etp rank copies its own shard.
"""

from dataclasses import replace

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_fold.common.tensors import waited
from titan_fold.compat.distributed import funcol
from titan_fold.moe.args import MoEArgs


def nominate(totals: torch.Tensor, R: int) -> torch.Tensor:
    """totals [E] rows per logical expert over every source -> the R busiest expert ids [R]."""
    return totals.topk(R).indices


def water_fill(totals: torch.Tensor, nominees: torch.Tensor, ep: int) -> torch.Tensor:
    """totals [E] rows per logical expert, nominees [R] -> cap_ends [ep]: the end of each ep rank's
    share of the nominees' rows, laid out nominee after nominee.

    Each rank is filled up to the lowest integer level W that holds every nominee row on top of
    the rows of its other experts: the smallest largest per-rank load when the nominees' rows may
    go anywhere (`oracle_max_load` checks it)."""
    E_loc = totals.numel() // ep
    load = totals.view(ep, E_loc).sum(1)  # [ep]
    moving = totals[nominees]  # [R]
    base = load - torch.zeros_like(load).index_add(0, nominees // E_loc, moving)  # [ep] rows that stay
    movable = moving.sum()
    # the level is ceil((movable + the k lightest bases) / k) for some k: the lowest that holds them
    k = torch.arange(1, ep + 1, device=totals.device)
    levels = (movable + base.sort().values.cumsum(0) + k - 1).div(k, rounding_mode="floor")  # [ep]
    room = (levels[:, None] - base[None, :]).clamp(min=0).sum(1)  # [ep] rows each level holds
    level = torch.where(room >= movable, levels, torch.iinfo(levels.dtype).max).min()
    return (level - base).clamp(min=0).cumsum(0)


def physical_experts(
    experts_idx: torch.Tensor, counts_of_source: torch.Tensor, me: int, ep: int, R: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """experts_idx [T, k] logical ids of this source's assignments; counts_of_source [S, E] rows
    each source of the ep x etp block sends each logical expert (the same table on every rank);
    me: this source's row -> (physical ids [T, k] in [0, ep * (E_loc + R)), nominees [R]).

    A nominee's rows, source after source and in assignment order within a source, take their
    places in the planner's stream; the rank whose share holds a row runs it, on its home expert
    or on its copy."""
    S, E = counts_of_source.shape
    E_loc = E // ep
    P_loc = E_loc + R
    totals = counts_of_source.sum(0)  # [E]
    nominees = nominate(totals, R)
    cap_ends = water_fill(totals, nominees, ep)
    flat = experts_idx.flatten()  # [N]
    dev = flat.device
    copy_of = torch.full((E,), -1, dtype=torch.int64, device=dev).scatter(0, nominees, torch.arange(R, device=dev))
    j = copy_of[flat]  # [N] the nominee index of each assignment, -1 for the rest
    moving = totals[nominees]
    stream_start = moving.cumsum(0) - moving  # [R] where each nominee's rows start in the stream
    before_me = counts_of_source[:me].sum(0)  # [E] rows of the earlier sources
    # each assignment's position among this source's rows of its expert (stable)
    order = torch.sort(flat, stable=True).indices
    starts = torch.searchsorted(flat[order], torch.arange(E, device=dev))  # [E]
    pos = torch.empty_like(flat).scatter(0, order, torch.arange(flat.numel(), device=dev) - starts[flat[order]])
    stream = stream_start[j.clamp(min=0)] + before_me[flat] + pos  # [N]
    rank = torch.searchsorted(cap_ends, stream, right=True).clamp(max=ep - 1)  # [N]
    home_rank = flat // E_loc
    home = home_rank * P_loc + flat % E_loc
    copy = rank * P_loc + E_loc + j.clamp(min=0)
    physical = torch.where((j < 0) | (rank == home_rank), home, copy)
    return physical.view_as(experts_idx), nominees


def oracle_max_load(counts: list[int], ep: int, nominees: list[int]) -> int:
    """The smallest largest per-rank load over every integer split of the nominees' rows over the
    ep ranks, by exhaustive search (small cases only): the planner's reference."""
    E_loc = len(counts) // ep
    base = [sum(counts[d * E_loc : (d + 1) * E_loc]) for d in range(ep)]
    for e in nominees:
        base[e // E_loc] -= counts[e]

    def splits(n: int, parts: int):
        if parts == 1:
            yield (n,)
            return
        for first in range(n + 1):
            for rest in splits(n - first, parts - 1):
                yield (first, *rest)

    loads = {tuple(base)}
    for e in nominees:
        loads = {tuple(load[d] + s[d] for d in range(ep)) for load in loads for s in splits(counts[e], ep)}
    return min(max(load) for load in loads)


class _Copies(torch.autograd.Function):
    """w [E_loc, ...] this rank's experts (or their etp shard) -> [R, ...] the nominees' weights:
    each rank puts in the rows of the nominees it holds, zeros elsewhere, and the sum over ep
    gives every rank each nominee's weights. Backward is the same sum over ep of the copies'
    gradients, of which each rank keeps its own nominees' rows, added to their home rows."""

    @staticmethod
    def forward(ctx, w, rows, mine, mesh):
        ctx.save_for_backward(rows, mine)
        ctx.shape, ctx.mesh = w.shape, mesh
        held = torch.where(mine.view(-1, *[1] * (w.dim() - 1)), w.index_select(0, rows), 0)  # [R, ...]
        return _sum(held, mesh)

    @staticmethod
    def backward(ctx, grad):
        rows, mine = ctx.saved_tensors
        summed = _sum(grad.contiguous(), ctx.mesh)  # [R, ...] every rank's copies' gradients
        summed = torch.where(mine.view(-1, *[1] * (grad.dim() - 1)), summed, 0)  # this rank's nominees
        return summed.new_zeros(ctx.shape).index_add(0, rows, summed), None, None, None


def _sum(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return waited(funcol.all_reduce(t, "sum", mesh))


def copies_of(w: torch.Tensor, nominees: torch.Tensor, ep_mesh: DeviceMesh) -> torch.Tensor:
    """w [E_loc, ...] this rank's experts (or their etp shard), nominees [R] logical ids -> [R, ...]
    the nominees' weights, each from its home rank."""
    E_loc, me = w.shape[0], ep_mesh.get_local_rank()
    mine = nominees // E_loc == me  # [R] the nominees this rank holds
    rows = torch.where(mine, nominees - me * E_loc, 0)  # [R] their rows here (0: a placeholder)
    return _Copies.apply(w, rows, mine, ep_mesh)


def plan_copies(dispatcher, experts_idx: torch.Tensor, args: MoEArgs):
    """A TokenDispatcher's layer call with copies (ep > 1): logical picks [T, k] -> (physical picks
    [T, k], the args of the physical experts, (weight [E_loc, ...], its name) -> with the copies
    [E_loc + R, ...]). Every rank of the ep x etp block plans alike, from every source's counts."""
    d = dispatcher
    E, R = args.num_experts, args.hot_expert_replicas
    flat = experts_idx.flatten()
    counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    every = d.counts.everywhere(d, counts)  # [etp * ep, E]
    me = d.ep_mesh.get_local_rank() + (0 if d.etp_mesh is None else d.etp_mesh.get_local_rank() * d.ep)
    physical, nominees = physical_experts(experts_idx, every, me, d.ep, R)

    def with_copies(w: torch.Tensor, name: str) -> torch.Tensor:
        return torch.cat([w, d.counts.copies(d, w, nominees, name)])

    return physical, replace(args, num_experts=E + d.ep * R), with_copies
