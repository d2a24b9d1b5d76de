"""The EP exchanges: how the routed rows of one layer call travel between the ep x etp ranks
and back, one object per `moe.exchange`, chosen once when the dispatcher is built (`choose`).

    exact    split sizes brought to the host (the layer's one sync); dropped rows cut off first
    padded   token drop with padding: every expert gets C rows, so every split is known
    static   dropless: every peer gets a worst-case block of rows, padding last; no host sync
    device   dropless: only the real rows move, their split sizes stay on the device

The dispatcher (moe/dispatcher.py) routes, asks its exchange where each row goes (`place`) and
how big the collectives are (`sizes`), groups the arrivals by local expert (`expert_of_row`),
runs the experts through it (`experts`) and combines. The device exchange runs the whole call
(`DeviceExchange.forward`) with one op:

The exact exchange brings every layer's split sizes to the host before its all-to-all (a
device-to-host copy and a wait); the static one sends each peer a worst-case block. The device
one moves only the real rows, and nothing leaves the device: on a GPU with NVSHMEM, symmetric
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

import torch

from titan_fold.common.tensors import waited
from titan_fold.compat.distributed import funcol, is_nvshmem_available, resolve_process_group, symmetric_memory
from titan_fold.moe.args import MoEArgs
from titan_fold.moe.counts import host_rows
from titan_fold.moe.rows import _by_expert, _fixed_rows, _inverse, _PermuteRows, _sum_rows


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
    """recv [cap + 1, dim] -> recv[gather] ([r, dim]) or, gather [T, k], each token's k rows
    summed in float, as the exact exchange's combine sums them."""
    if gather.dim() == 1:
        return recv[gather]
    return _sum_rows(recv, gather.flatten(), gather.shape[1])


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


# ---- the exchanges --------------------------------------------------------------------------
# Each method takes the dispatcher `d` asking (its meshes, degrees, counts and stash), as
# moe/counts.py's methods do. Shapes: N = T * k assignments, R rows sent, E_loc local experts.


@dataclass
class Splits:
    """The collectives' split sizes on the host; None: equal splits (fixed blocks)."""

    send: list[int] | None  # rows to each ep rank
    recv: list[int] | None  # rows from each ep rank
    gather: list[int] | None  # rows of each etp rank after its all-to-all


class ExactExchange:
    """moe.exchange = "exact": the rows grouped by destination expert, dropped ones last and cut
    off before they travel; the split sizes reach the host. The subclasses change where rows
    are placed and how big the collectives are."""

    positions = False  # place() reads each assignment's position within its group

    def place(self, d, key, order, counts, pos, weights, T: int, k: int, cap):
        """key [N] destination expert of each assignment (E: dropped), order [N] the assignments
        grouped by key, counts [E] kept rows per expert, pos [N] or None, weights [N] -> (token_of_row
        [R], slot [N]: row of each assignment, weight_of_row [R], rows_per_expert [E] or C)."""
        slot = _inverse(order)  # [N] row of each assignment
        weight_of_row = _PermuteRows.apply(weights, order, slot)  # backward a gather, not a scatter-add
        return order // k, slot, weight_of_row, counts

    def sizes(self, d, rows_per_expert, E_loc: int, rows: int, dropped: bool, device: torch.device):
        """-> (Splits or None, rows_of_source [etp*ep, E_loc] or None, the rows to send: None = all).
        None and None with ep x etp = 1: nothing travels."""
        if d.ep * d.etp == 1:
            # dynamic shapes: the layer's one host sync
            return None, None, host_rows(int(rows_per_expert.sum()), rows) if dropped else None
        # no read of experts.w13 here: under FSDP2 it is still sharded until experts() runs
        splits, rows_of_source = d._splits(rows_per_expert, E_loc, rows)
        return splits, rows_of_source, host_rows(sum(splits.send), rows)  # the dropped rows cut off

    def expert_of_row(self, rows_of_source: torch.Tensor, R_all: int) -> torch.Tensor:
        """rows_of_source [S, E_loc] -> [R_all] local expert of each arrival (by source, then expert)."""
        S, E_loc = rows_of_source.shape
        expert_of_row = torch.arange(E_loc, device=rows_of_source.device).repeat(S)
        return expert_of_row.repeat_interleave(rows_of_source.flatten(), output_size=R_all)

    def experts(self, d, experts, x_sorted, local_counts, w_sorted, args: MoEArgs, copies=None):
        """The experts over the arrivals grouped by local expert: x_sorted [R_all, dim], w_sorted [R_all]."""
        return experts(x_sorted, local_counts, w_sorted, args.prob_before_w2, copies=copies)


class PaddedExchange(ExactExchange):
    """Token drop padded to capacity: expert e owns rows [e*C, (e+1)*C) on every source, so every
    split is E_loc * C rows and nothing reaches the host."""

    positions = True

    def place(self, d, key, order, counts, pos, weights, T: int, k: int, cap):
        E = counts.numel()
        C = min(cap, T)  # one expert cannot get more than T of this rank's assignments
        slot = torch.where(key < E, key * C + pos, E * C)  # [N]; dropped -> a spare slot
        token_of_row, weight_of_row = _fixed_rows(slot, E * C, weights, k)
        return token_of_row, slot, weight_of_row, C

    def sizes(self, d, rows_per_expert, E_loc: int, rows: int, dropped: bool, device: torch.device):
        if d.ep * d.etp == 1:
            return None, None, None
        full = torch.full((d.etp * d.ep, E_loc), rows_per_expert, dtype=torch.int64, device=device)
        return Splits(None, None, None), full, None

    def expert_of_row(self, rows_of_source: torch.Tensor, R_all: int) -> torch.Tensor:
        # every source sent a block of B rows: its rows by expert, then padding
        S = rows_of_source.shape[0]
        B = R_all // S
        ends = rows_of_source.cumsum(1)  # [S, E_loc] end of each expert's rows in its block
        within = torch.arange(B, device=rows_of_source.device).expand(S, B).contiguous()
        return torch.searchsorted(ends, within, right=True).flatten()  # [R_all], E_loc = padding


class StaticExchange(PaddedExchange):
    """moe.exchange = "static", dropless: ep peer p owns rows [p*B, (p+1)*B) of the rows sent,
    its rows by expert first, padding after; B is the most rows one peer can get from this rank.
    The counts stay on the device."""

    def place(self, d, key, order, counts, pos, weights, T: int, k: int, cap):
        E_loc = counts.numel() // d.ep
        B = T * min(k, E_loc)  # a token's k experts are distinct: at most E_loc on one peer
        per_peer = counts.view(d.ep, E_loc)
        before = (per_peer.cumsum(1) - per_peer).flatten()  # [E] rows of the peer's earlier experts
        slot = (key // E_loc) * B + before[key] + pos  # [N]
        token_of_row, weight_of_row = _fixed_rows(slot, d.ep * B, weights, k)
        return token_of_row, slot, weight_of_row, counts

    def sizes(self, d, rows_per_expert, E_loc: int, rows: int, dropped: bool, device: torch.device):
        sources = d.counts.sources(d, rows_per_expert, rows)  # every split a fixed block
        return Splits(None, None, None), sources.view(d.etp * d.ep, E_loc), None

    def experts(self, d, experts, x_sorted, local_counts, w_sorted, args: MoEArgs, copies=None):
        """Rows by local expert that end in padding: local_counts [E_loc] sum to the V real rows.
        The experts skip the rows past the last group and leave their outputs and input gradients
        undefined (uninitialized memory): zeros in both directions instead."""
        R_all = x_sorted.shape[0]
        V = local_counts.sum()
        valid = torch.arange(R_all, device=x_sorted.device) < V  # [R_all]
        x_sorted, w_sorted = torch.where(valid[:, None], x_sorted, 0), torch.where(valid, w_sorted, 0)
        if d.stash is not None:  # what the experts save for backward: the V real rows only
            y_sorted = d.stash.call(V, R_all, experts, x_sorted, local_counts, w_sorted, args.prob_before_w2)
        else:
            y_sorted = experts(x_sorted, local_counts, w_sorted, args.prob_before_w2)
        return torch.where(valid[:, None], y_sorted, 0)


class DeviceExchange:
    """moe.exchange = "device", dropless over ep (and etp): rows arrive already grouped by local
    expert, in a buffer of the most rows this rank can receive, real rows first; no host sync.
    It runs the whole layer call (`forward`): ep_exchange gathers, sends and sums by itself."""

    def forward(self, d, x, probs, order, counts, experts, args: MoEArgs, overlap=None):
        """x [T, dim], probs [T, k], order [N] assignments grouped by expert, counts [E] ->
        (y [T, dim], overlap() or None)."""
        T, k = probs.shape
        N, ep = T * k, d.ep
        E_loc = counts.numel() // ep
        token_of_row = order // k  # [N] rows by destination expert, so by ep rank
        slot = _inverse(order)  # [N] row of each assignment
        send = counts.view(ep, E_loc).sum(1)  # [ep] rows to each ep rank
        # [etp, ep, E_loc]: rows each (etp, ep) source sends each local expert
        every = d.counts.sources(d, counts, N).view(d.etp, ep, E_loc)
        sources = every[0 if d.etp_mesh is None else d.etp_mesh.get_local_rank()]  # [ep, E_loc] this rank's
        recv = sources.sum(1)  # [ep]
        R = ep * T * min(k, E_loc)  # the most rows this rank can get: a token's k experts are distinct
        cap = max(R, N)
        perm, inv = _by_expert(sources, R, cap)
        g = d.ep_group_name
        there, back = Route(token_of_row, send, recv, perm), Route(inv, recv, send, slot.view(T, k))
        x_sorted = exchange(x, there, back, cap, g)  # [R, dim]
        w_sorted = exchange(
            probs.flatten(), Route(order, send, recv, perm), Route(inv, recv, send, slot.view(N, 1)), cap, g
        )
        overlapped = overlap() if overlap is not None else None
        # no masks: the padding rows came in as zeros, their outputs are never sent, and their
        # gradients come back as zeros (the zero row)
        if d.etp > 1:
            y_sorted = self._etp(d, x_sorted, w_sorted, every.sum(1), experts, args)
        else:
            y_sorted = experts(x_sorted, sources.sum(0), w_sorted, args.prob_before_w2)  # [R, dim]
        y = exchange(y_sorted, back, there, cap, g)  # [T, dim]
        return y, overlapped

    def _etp(self, d, x_sorted, w_sorted, per_rank, experts, args: MoEArgs):
        """The etp part: x_sorted [R, dim], w_sorted [R] (this rank's arrivals by local expert,
        real rows first), per_rank [etp, E_loc] (each etp rank's rows per local expert) -> the
        experts' output rows [R, dim], summed over etp. The all-gather-v and the reduce-scatter-v
        are ep_exchange over the etp group (each rank's real rows to every peer, the partial
        outputs back and summed), into buffers of etp x R rows."""
        assert d.etp_mesh is not None  # etp > 1
        etp, R = d.etp, x_sorted.shape[0]
        dev, cap = x_sorted.device, etp * R
        rows = per_rank.sum(1)  # [etp] real rows of each etp rank
        me = rows[d.etp_mesh.get_local_rank()]
        # each etp rank's real rows are by expert: the gathered buffer is (etp rank, expert) blocks
        perm, inv = _by_expert(per_rank, cap, cap)
        spread = torch.arange(cap, device=dev) % me.clamp(min=1)  # [cap] rows 0 .. me-1 for every peer
        local = torch.arange(R, device=dev)[:, None]  # [R, 1]
        mine = torch.arange(etp, device=dev)[None, :] * me + local  # [R, etp] my row from each peer
        mine = torch.where(local < me, mine, cap)
        g = d.etp_group_name
        same = me.expand(etp).contiguous()
        gather, scatter = Route(spread, same, rows, perm), Route(inv, rows, same, mine)
        x_grouped = exchange(x_sorted, gather, scatter, cap, g)  # [etp * R, dim] by expert
        w_grouped = exchange(w_sorted, gather, scatter, cap, g)
        y_grouped = experts(x_grouped, per_rank.sum(0), w_grouped, args.prob_before_w2)
        return exchange(y_grouped, scatter, gather, cap, g)  # [R, dim] summed over etp


def choose(args: MoEArgs, ep: int, etp: int) -> ExactExchange | DeviceExchange:
    """The exchange a dispatcher over ep x etp runs for these settings (the rules in
    common/rules.py refuse static and device with token drop)."""
    choice = resolve(args.exchange, ep, etp)
    if choice == "device":
        return DeviceExchange()
    if args.token_drop == "drop_and_pad":
        return PaddedExchange()
    if choice == "static" and args.token_drop == "dropless":
        return StaticExchange()
    return ExactExchange()
