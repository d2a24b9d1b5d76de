"""Token dispatcher: capacity, permutation, EP x ETP exchange, expert compute, combine.

One class serves every folding: it only sees "the tokens of this rank". With both
degrees 1 every collective below is the identity and no count leaves the device, so the
single-rank layer is this same code.

Forward of one layer (rank r, N = T * top_k assignments):

    keep mask        token drop only: capacity per expert, by probs or by position,
                     on local tokens (sub_sequence) or on the whole sequences (full_sequence)
    permute          rows grouped by destination expert; dropped ones last (or padded slots;
                     or, static exchange, a worst-case block of rows per ep peer, padding last)
    counts           all-to-all over ep, all-gather over etp, ONE .tolist() (none if padded or static)
    all-to-all-v     over ep: rows go to the rank that owns their expert
    all-gather-v     over etp: every etp rank sees all rows of its local experts
    group            rows sorted by local expert -> grouped GEMM on the ffn shard
    reduce-scatter-v over etp: partial w2 products summed, each rank gets its rows back
    all-to-all-v     over ep, back
    combine          gather each token's rows and sum them (the probability is already applied)

Where rows are placed, how big the collectives are and how the arrivals are grouped is the
dispatcher's exchange (moe/exchange.py), chosen once when it is built; forward runs its phases
(route, send, compute, back). The device exchange moves rows with its own op, without the
permute and combine above. All collectives are functional and autograd-aware:
backward mirrors forward (all-to-all reversed, all-gather <-> reduce-scatter) without
hand-written communication code.
Gloo has no uneven all-gather, so all-gather-v and reduce-scatter-v are all-to-alls.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan_fold.compat.distributed import funcol
from titan_fold.moe.args import MoEArgs
from titan_fold.moe.counts import ExchangedCounts
from titan_fold.moe.exchange import ExactExchange, Splits, choose
from titan_fold.moe.experts import GroupedExperts, compute_dtype
from titan_fold.moe.rows import _Combine, _Dispatch, _inverse, _PermuteRows, group_by
from titan_fold.moe.stash import Stash


def capacity(num_tokens: int, factor: float, args: MoEArgs) -> int:
    """The most assignments an expert keeps of num_tokens * top_k, at capacity factor `factor`."""
    return math.ceil(num_tokens * args.top_k * factor / args.num_experts)


def capacity_keep(probs: torch.Tensor, experts: torch.Tensor, num_experts: int, cap: int, policy: str) -> torch.Tensor:
    """probs, experts [T, k] -> keep [T, k] bool: at most `cap` assignments per expert.

    policy "probs": the highest routing weights win (ties: earlier assignment);
    "position": the first arrivals in token order win.
    """
    flat = experts.flatten()  # [N], token-major order
    if policy == "probs":
        prio = torch.sort(probs.flatten(), descending=True, stable=True).indices
    else:
        prio = torch.arange(flat.numel(), device=flat.device)
    _, _, pos = group_by(flat[prio], num_experts)  # position within expert, in priority order
    keep = torch.empty(flat.numel(), dtype=torch.bool, device=flat.device).scatter(0, prio, pos < cap)
    return keep.view_as(experts)


# ---- collectives over a 1-D mesh; None means degree 1 (identity) -------------------------


def _size(mesh: DeviceMesh | None) -> int:
    return 1 if mesh is None else mesh.size()


def _all_gather_v(x: torch.Tensor, sizes, mesh: DeviceMesh | None) -> torch.Tensor:
    """[n_me, ...] -> [sum(sizes), ...], rank order; sizes None = all equal."""
    if mesh is None:
        return x
    n = mesh.size()
    send = x.repeat(n, *[1] * (x.dim() - 1))  # every rank gets the whole chunk
    return funcol.all_to_all_single_autograd(send, sizes, None if sizes is None else [x.shape[0]] * n, mesh)


def _reduce_scatter_v(y: torch.Tensor, sizes, mesh: DeviceMesh | None) -> torch.Tensor:
    """[sum(sizes), ...] -> [sizes[me], ...] summed over ranks; sizes None = all equal."""
    if mesh is None:
        return y
    n = mesh.size()
    mine = y.shape[0] // n if sizes is None else sizes[mesh.get_local_rank()]
    parts = funcol.all_to_all_single_autograd(y, None if sizes is None else [mine] * n, sizes, mesh)
    # in y's dtype: CUDA autocast would sum in float32 and hand the combine float32 rows
    # (the residual stream turned float32, and the fused sum compiled for a second dtype)
    return parts.view(n, mine, *y.shape[1:]).sum(0, dtype=y.dtype)


@dataclass
class Plan:
    """Where one layer call's rows go and come back: what permute decided for the later phases."""

    token_of_row: torch.Tensor  # [R] token of each row sent
    slot: torch.Tensor  # [T*k] row of each assignment
    k: int
    keep: torch.Tensor | None  # [T, k] kept assignments (token drop)
    rows_per_expert: torch.Tensor | int  # [E] rows for each expert, or C (padded)
    splits: Splits | None = None  # with an exchange: sizes of its collectives
    rows_of_source: torch.Tensor | None = None  # [etp*ep, E_loc] rows each source sends each local expert
    # moe.hot_expert_replicas: (local experts' weight [E_loc, ...], its name) -> with the copies [P_loc, ...]
    copies: Callable[[torch.Tensor, str], torch.Tensor] | None = None
    args: MoEArgs | None = None  # the layer's settings for this call (with copies: their experts too)
    in_place: bool = False  # one rank: the experts read each row from x


class TokenDispatcher(nn.Module):
    """args: the layer's settings; with ep and etp they pick the exchange (moe/exchange.py: choose).
    ep_mesh, etp_mesh: 1-D meshes of the expert mapping (None = degree 1).
    seq_mesh: 1-D mesh of the ranks holding the other parts of this rank's sequences
    (attention cp x tp), read by the router's aux-loss statistics and full_sequence dropping.
    seq_positions: where each rank's tokens sit in the whole sequence (cp's load-balanced
    chunks); None: local token slices are contiguous chunks, in mesh-rank order."""

    def __init__(
        self,
        args: MoEArgs,
        ep_mesh: DeviceMesh | None = None,
        etp_mesh: DeviceMesh | None = None,
        seq_mesh: DeviceMesh | None = None,
        seq_positions: Callable[[int], torch.Tensor] | None = None,
    ):
        super().__init__()
        self.ep_mesh, self.etp_mesh, self.seq_mesh = ep_mesh, etp_mesh, seq_mesh
        self.ep, self.etp = _size(ep_mesh), _size(etp_mesh)
        # how the rows travel (moe/exchange.py): from moe.exchange, token drop and ep x etp
        self.exchange = choose(args, self.ep, self.etp)
        # the device exchange's ops name their process group
        self.ep_group_name = ep_mesh.get_group().group_name if ep_mesh is not None else ""
        self.etp_group_name = etp_mesh.get_group().group_name if etp_mesh is not None else ""
        # local tokens per sequence -> [seq_mesh size * that] position in the whole sequence
        # of each token, rank after rank; None: every rank holds one contiguous chunk
        self.seq_positions = seq_positions
        # what it learns from the other ranks: by collectives over these groups (moe/counts.py)
        self.counts = ExchangedCounts()
        # moe.stash_rows: the pools (moe/stash.py) shared by the MoE layers of a model part, or None
        self.stash: Stash | None = None

    def keep_mask(self, probs, experts, num_seqs: int, args: MoEArgs):
        """-> (keep [T, k] bool, capacity) or (None, None) when dropless."""
        factor, seq_mesh = args.capacity_factor, self.seq_mesh
        if args.token_drop == "dropless":
            return None, None
        assert factor is not None  # MoEArgs refuses token drop without a capacity factor
        T, k = experts.shape
        if args.drop_scope == "sub_sequence" or seq_mesh is None or seq_mesh.size() == 1:
            cap = capacity(T, factor, args)
            return capacity_keep(probs, experts, args.num_experts, cap, args.drop_policy), cap
        # full_sequence: decide on the whole sequences exactly as one rank holding them would
        n, L = seq_mesh.size(), T // num_seqs
        packed = torch.cat([probs.detach().double(), experts.double()], dim=-1)  # [T, 2k], ids exact in f64
        full = self.counts.sequences(self, packed)  # [n * T, 2k], rank-major
        full = full.view(n, num_seqs, L, 2 * k).transpose(0, 1).reshape(num_seqs, n * L, 2 * k)  # by sequence
        pos = None if self.seq_positions is None else self.seq_positions(L).to(full.device)  # [n * L]
        if pos is not None:  # e.g. cp's load-balanced chunks: put each sequence in order
            full = full.index_select(1, torch.argsort(pos))
        full = full.reshape(num_seqs * n * L, 2 * k)
        cap = capacity(n * T, factor, args)
        keep = capacity_keep(full[:, :k], full[:, k:].long(), args.num_experts, cap, args.drop_policy)
        keep = keep.view(num_seqs, n * L, k)
        if pos is not None:
            keep = keep.index_select(1, pos)  # back to rank-major
        mine = keep.view(num_seqs, n, L, k)[:, seq_mesh.get_local_rank()]
        return mine.reshape(T, k), cap

    def forward(
        self,
        x: torch.Tensor,
        probs: torch.Tensor,
        experts_idx: torch.Tensor,
        experts: GroupedExperts,
        args: MoEArgs,
        num_seqs: int,
        overlap=None,
    ):
        """x [T, dim], probs/experts_idx [T, k] -> (y [T, dim], keep [T, k] bool or None,
        overlap() or None).

        overlap: work that does not depend on the routed experts (the shared expert), run
        while the tokens are on their way: after the EP all-to-all is issued and before its
        result is read (functional collectives wait at first use), so that on a GPU its
        kernels run beside the exchange; without an exchange, before the experts.

        The dispatcher's exchange (moe/exchange.py) runs the phases: route (the rows grouped by
        destination), send, compute, back. The exact exchanges route with permute, compute with
        compute and bring the rows back with unpermute, methods of their own that the
        two-micro-batch schedule (parallel/overlap.py) runs apart."""
        # rows travel in the experts' dtype (bf16 under autocast over an fp32 residual stream):
        # half the bytes, and the gradient's sum over k sees the dtype the combine sees
        x = x.to(compute_dtype(x))
        exchange = self.exchange
        plan, x_rows, w_rows = exchange.route(self, x, probs, experts_idx, experts, args, num_seqs)
        x_in, w_in = exchange.send(self, x_rows, w_rows, plan, experts)
        overlapped = overlap() if overlap is not None else None  # while the rows travel
        y_in = exchange.compute(self, x_in, w_in, plan, experts)
        return exchange.back(self, y_in, plan), plan.keep, overlapped

    def permute(
        self,
        x: torch.Tensor,
        probs: torch.Tensor,
        experts_idx: torch.Tensor,
        args: MoEArgs,
        num_seqs: int,
        gather_rows: bool = True,
    ) -> tuple["Plan", torch.Tensor, torch.Tensor]:
        """Drop decisions, rows grouped by destination, split sizes exchanged (the layer's one
        host sync, none with static shapes) -> (plan, x_rows [R, dim], w_rows [R]: the rows to
        send and their weights).
        gather_rows False (one rank, dropless): x itself in place of x_rows."""
        T, k = experts_idx.shape
        E = args.num_experts
        keep, cap = self.keep_mask(probs, experts_idx, num_seqs, args)

        key = experts_idx.flatten()  # [N] destination expert of each assignment
        if keep is not None:
            key = torch.where(keep.flatten(), key, E)  # dropped -> an extra last group
        exchange = self.exchange
        assert isinstance(exchange, ExactExchange)  # the device exchange places rows its own way
        order, counts, pos = group_by(key, E + 1, positions=exchange.positions)
        counts = counts[:E]  # [E] kept rows per expert
        token_of_row, slot, weight_of_row, rows_per_expert = exchange.place(
            self, key, order, counts, pos, probs.flatten(), T, k, cap
        )
        dropped = keep is not None
        x = x.to(compute_dtype(x))
        plan = Plan(token_of_row, slot, k, keep, rows_per_expert)
        if not gather_rows:
            return plan, x, weight_of_row
        x_rows = _Dispatch.apply(x, token_of_row, slot, k, dropped)  # [R, dim]
        E_loc = E // self.ep
        plan.splits, plan.rows_of_source, n = exchange.sizes(
            self, rows_per_expert, E_loc, x_rows.shape[0], dropped, x_rows.device
        )
        if n is not None:
            x_rows, weight_of_row = x_rows[:n], weight_of_row[:n]  # cut the dropped rows off
        return plan, x_rows, weight_of_row

    def compute(
        self, x_in: torch.Tensor, w_in: torch.Tensor, plan: "Plan", experts: GroupedExperts, args: MoEArgs
    ) -> torch.Tensor:
        """Rows that arrived over ep -> the experts' output rows, summed over etp, to send back.
        x_in [sum(recv), dim], w_in [sum(recv)], by (ep source, expert)."""
        sp, rows_of_source = plan.splits, plan.rows_of_source
        assert sp is not None and rows_of_source is not None  # permute sets both when ep x etp > 1
        x_all = _all_gather_v(x_in, sp.gather, self.etp_mesh)  # [R_all, dim], by (etp, ep source, expert)
        w_all = _all_gather_v(w_in, sp.gather, self.etp_mesh)

        # group rows by local expert (stable: keeps source order inside an expert), padding last
        exchange = self.exchange
        assert isinstance(exchange, ExactExchange)  # the device exchange computes its own way
        expert_of_row = exchange.expert_of_row(rows_of_source, x_all.shape[0])  # [R_all]
        perm = torch.sort(expert_of_row, stable=True).indices  # [R_all]
        inv = _inverse(perm)
        counts = plan.rows_per_expert
        S = rows_of_source.shape[0]
        local_counts = S * counts if isinstance(counts, int) else rows_of_source.sum(0)  # [E_loc]
        x_sorted, w_sorted = _PermuteRows.apply(x_all, perm, inv), w_all[perm]
        y_sorted = exchange.experts(self, experts, x_sorted, local_counts, w_sorted, args, plan.copies)
        y_all = _PermuteRows.apply(y_sorted, inv, perm)  # back to arrival order
        return _reduce_scatter_v(y_all, sp.gather, self.etp_mesh)  # [sum(recv), dim] summed over etp

    def unpermute(self, y_rows: torch.Tensor, plan: "Plan") -> torch.Tensor:
        """The experts' rows back on this rank [R, dim] -> y [T, dim], each token the sum of its rows."""
        R = y_rows.shape[0]
        dropped = plan.keep is not None
        # dropped rows were cut off: their assignments read the zero row
        slot = plan.slot.clamp(max=R) if dropped else plan.slot
        # in the experts' dtype (bf16 under autocast)
        return _Combine.apply(y_rows, plan.token_of_row[:R], slot, plan.k, dropped)

    def _splits(self, counts: torch.Tensor, E_loc: int, rows: int):
        """The exact exchange's sizes: exchange counts [E] and bring the split sizes to the host,
        the layer's one sync. rows: this rank's routed rows (the sum of counts without drops).

        -> (Splits, rows_of_source [etp*ep, E_loc] on device: rows each (etp, ep) source
        sends to each local expert)."""
        ep, etp = self.ep, self.etp
        gathered = self.counts.sources(self, counts, rows)
        sent, got = self.counts.on_host(self, counts, gathered, rows)
        block = lambda flat, i: sum(flat[i * E_loc : (i + 1) * E_loc])  # noqa: E731
        me = 0 if self.etp_mesh is None else self.etp_mesh.get_local_rank()
        splits = Splits(
            send=[block(sent, d) for d in range(ep)],
            recv=[block(got, me * ep + s) for s in range(ep)],
            gather=[sum(block(got, j * ep + s) for s in range(ep)) for j in range(etp)],
        )
        return splits, gathered.view(etp * ep, E_loc)
