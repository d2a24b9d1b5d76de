"""Newton-Schulz on whole matrices of sharded parameters: each matrix gathered on one owner
rank, orthogonalized there once, and its shards sent back.

Muon (trainer/muon.py) orthogonalizes whole matrices; the folding leaves each rank shards of
them: TP splits attention's and the shared expert's matrices by rows or columns, FSDP / HSDP
splits them again over dp_shard x cp, and a routed expert's matrices live on one ep rank, split
by rows or columns over etp and once more over edp. A parameter's DTensor placements say which
slice of every tensor dim each rank of its mesh holds; that is all this module reads, so any mix
of `Shard` (torch's strided shards too) and `Replicate` over any mesh dims is handled alike.

The units: a 2-D parameter is one unit, a stack of experts [E, A, B] has E units (w13's unit
is two matrices, its gate and up rows). Every unit gets one owner among its mesh's ranks, chosen
once (`assign_owners`): units by Newton-Schulz FLOPs, largest first, each to the rank with the
fewest FLOPs so far (longest-processing-time-first), counting the FLOPs of all parameters whose
meshes span the same ranks together (attention's and the experts' meshes both span the pipeline
stage), so that no rank gets much more than the mean. One step, per mesh:

    gather   all-to-all over the mesh's ranks: each rank sends every owner its pieces of the
             owner's units, from the ranks that hold the owner's copy (those with the owner's
             coordinates on the Replicate dims); the owner assembles each unit whole
    compute  each owner orthogonalizes its units, those of one matrix shape in one batch
    scatter  all-to-all back: every rank of the mesh (every replica) gets its piece of each
             unit's result

Each element of a matrix travels once to its owner, and once per rank that holds it back (the
FSDP / TP shards' bytes, plus the copies on Replicate dims). A plain tensor (one rank, or a
parameter no mesh splits) is orthogonalized where it is, batched the same way.
"""

import heapq
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from titan_fold.compat.distributed import flatten_mesh
from titan_fold.models.groups import from_matrices, matrices, matrix_shape


def newton_schulz(
    x: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """x [..., A, B] -> its Newton-Schulz orthogonalization, each matrix on its own, computed in
    `dtype` and returned in it (torch.optim.Muon's iteration; on [A, B] its very ops)."""
    a, b, c = coefficients
    y = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        y = y.mT
    if y.ndim == 2:
        y = y / y.norm().clamp(min=eps)
        for _ in range(steps):
            gram = y @ y.T
            y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    else:
        y = y.flatten(0, -3)
        y = y / torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = y @ y.mT
            y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
        y = y.view(*x.shape[:-2], *y.shape[-2:])
    return y.mT if tall else y


def ns_flops(shape: tuple[int, int], steps: int) -> int:
    """Newton-Schulz's multiply-add FLOPs on one matrix [A, B] (m = min, n = max): per step the
    Gram matrix (2 m^2 n), its square (2 m^3) and the product with the matrix (2 m^2 n)."""
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def _shards(placement) -> int | None:
    """The tensor dim a placement splits (Shard, torch's _StridedShard), or None (Replicate)."""
    if placement.is_replicate():
        return None
    if placement.is_partial():
        raise ValueError(f"a Muon parameter placed {placement}: parameters are Shard or Replicate")
    return placement.dim


def _on_dim0(placement):
    """The same split of a 1-D tensor (dim 0)."""
    if hasattr(placement, "split_factor"):  # a strided shard
        return type(placement)(0, split_factor=placement.split_factor)
    return type(placement)(0)


def local_indices(p: DTensor) -> list[torch.Tensor]:
    """The global indices, along each tensor dim, of this rank's local shard of p, in the local
    tensor's order (a local shard is the product of one index set per dim)."""
    out = []
    for d, size in enumerate(p.shape):
        placements = [_on_dim0(pl) if _shards(pl) == d else Replicate() for pl in p.placements]
        out.append(
            distribute_tensor(torch.arange(size), p.device_mesh, placements, src_data_rank=None).to_local().cpu()
        )
    return out


@dataclass(eq=False)
class Entry:
    """One Muon parameter: its units, and for a DTensor where each rank of its mesh holds what."""

    name: str
    param: torch.Tensor
    units: int  # E for a stack of experts, else 1
    cost: int  # Newton-Schulz FLOPs of one unit
    owners: list[int] = field(default_factory=list)  # per unit: the owner's position in the mesh
    slice_key: list[tuple] = field(default_factory=list)  # per mesh position: its coordinates on Replicate dims
    held: list[dict[int, int]] = field(default_factory=list)  # per mesh position: {unit: its index in the local tensor}
    pieces: list[tuple] = field(default_factory=list)  # per mesh position: the index of its piece in a unit
    piece_shapes: list[tuple[int, int]] = field(default_factory=list)  # per mesh position: its piece's shape

    @property
    def stacked(self) -> bool:
        return self.param.ndim == 3

    def set_indices(self, indices: list[list[torch.Tensor]], device) -> None:
        """Each mesh position's local_indices -> which units it holds pieces of, and the rows and
        columns of its piece of a unit (on `device`)."""
        self.held, self.pieces, self.piece_shapes = [], [], []
        for idx in indices:
            rows, cols = idx[-2:]
            whole = len(rows) > 0 and len(cols) > 0
            units = [(int(u), k) for k, u in enumerate(idx[0])] if self.stacked else [(0, 0)]
            self.held.append(dict(units) if whole else {})
            self.pieces.append(_piece_index(rows, cols, device))
            self.piece_shapes.append((len(rows), len(cols)))

    def piece_numel(self, pos: int) -> int:
        rows, cols = self.piece_shapes[pos]
        return rows * cols


def entries_of(named: list[tuple[str, torch.Tensor]], ns_steps: int) -> list[Entry]:
    """An Entry per Muon parameter of `named`, with its units and their Newton-Schulz FLOPs."""
    return [
        Entry(
            name,
            p,
            p.shape[0] if p.ndim == 3 else 1,
            (2 if name.endswith(".experts.w13") else 1) * ns_flops(matrix_shape(name, p.shape), ns_steps),
        )
        for name, p in named
    ]


def _piece_index(rows: torch.Tensor, cols: torch.Tensor, device) -> tuple:
    """The index of the piece [rows, cols] of a matrix: a slice for a run of consecutive indices
    (a plain Shard's, a view), else index tensors on `device` (a strided shard's)."""
    runs = [
        slice(int(i[0]), int(i[-1]) + 1)
        if len(i) and torch.equal(i, torch.arange(int(i[0]), int(i[0]) + len(i)))
        else None
        for i in (rows, cols)
    ]
    if None not in runs:
        return tuple(runs)
    return rows.to(device)[:, None], cols.to(device)[None, :]


def assign_owners(entries: list[Entry], ranks: Callable[[Entry], list[int]]) -> dict[int, int]:
    """Each unit of each entry to a position of its mesh (Entry.owners), largest Newton-Schulz
    FLOPs first, each to the rank with the fewest so far (the lowest rank of those tied);
    ranks(entry): its mesh's global ranks by position. Entries whose meshes span the same ranks
    share one count. -> FLOPs per global rank."""
    units = sorted(
        ((e.cost, i, u) for i, e in enumerate(entries) for u in range(e.units)), key=lambda t: (-t[0], t[1], t[2])
    )
    for e in entries:
        e.owners = [0] * e.units
    # one count per set of ranks, a heap of (FLOPs, rank): every rank of a set sees the same
    # entries on it, so all of them agree on the owners
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    positions: dict[tuple[int, ...], dict[int, int]] = {}
    for cost, i, u in units:
        members = tuple(ranks(entries[i]))
        key = tuple(sorted(members))
        heap = heaps.setdefault(key, [(0, r) for r in key])
        load, rank = heapq.heappop(heap)
        entries[i].owners[u] = positions.setdefault(members, {r: k for k, r in enumerate(members)})[rank]
        heapq.heappush(heap, (load + cost, rank))
    total: dict[int, int] = defaultdict(int)
    for heap in heaps.values():
        for load, rank in heap:
            total[rank] += load
    return dict(total)


def _group(mesh: DeviceMesh):
    return mesh.get_group() if mesh.ndim == 1 else flatten_mesh(mesh).get_group()


class Orthogonalizer:
    """The orthogonalized updates of the Muon parameters `named` ([(name, parameter)]), each
    unit on its owner (module docstring). Built once per set of parameters: the owners and every
    rank's shard indices (one object all-gather per mesh)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], ns_steps: int):
        self.entries = entries_of(named, ns_steps)
        self.meshes: dict[tuple, list[Entry]] = defaultdict(list)  # by mesh (its ranks and shape)
        self.mesh_of: dict[tuple, DeviceMesh] = {}
        self.groups: dict[tuple, object] = {}
        for e in self.entries:
            if isinstance(e.param, DTensor) and e.param.device_mesh.size() > 1:
                mesh = e.param.device_mesh
                key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape))
                self.meshes[key].append(e)
                self.mesh_of[key] = mesh
        for key, entries in self.meshes.items():
            self.groups[key] = _group(self.mesh_of[key])
            self._index(self.mesh_of[key], self.groups[key], entries)
        self.plain = [e for e in self.entries if all(e not in es for es in self.meshes.values())]
        ranks = {id(e): list(key[0]) for key, entries in self.meshes.items() for e in entries}
        self.loads = assign_owners(
            self.entries, lambda e: ranks.get(id(e), [dist.get_rank() if dist.is_initialized() else 0])
        )

    @staticmethod
    def _index(mesh: DeviceMesh, group, entries: list[Entry]) -> None:
        """Every rank's local_indices of every entry on `mesh`, and its coordinates on the entry's Replicate dims."""
        mine = [[i.tolist() for i in local_indices(e.param)] for e in entries]
        gathered = [None] * mesh.size()
        dist.all_gather_object(gathered, mine, group=group)
        members = mesh.mesh.flatten().tolist()
        by_pos = [gathered[dist.get_group_rank(group, g)] for g in members]
        coords = [
            tuple(int(c) for c in torch.unravel_index(torch.tensor(pos), tuple(mesh.mesh.shape)))
            for pos in range(len(members))
        ]
        for k, e in enumerate(entries):
            e.set_indices(
                [[torch.tensor(i, dtype=torch.long) for i in by_pos[pos][k]] for pos in range(len(members))],
                e.param.to_local().device,
            )
            replicated = [dim for dim, pl in enumerate(e.param.placements) if _shards(pl) is None]
            e.slice_key = [tuple(c[dim] for dim in replicated) for c in coords]

    def __call__(
        self, updates: list[torch.Tensor], orthogonalize: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """updates: each parameter's local update (placed as the parameter) -> its local
        orthogonalized update in `dtype`; orthogonalize: [n, A, B] -> [n, A, B] in `dtype`."""
        local_of = {id(e): u for e, u in zip(self.entries, updates, strict=True)}
        out = {}
        units = [(e, u) for e in self.plain for u in range(e.units)]
        whole = {(id(e), u): local_of[id(e)][u] if e.stacked else local_of[id(e)] for e, u in units}
        done = _orthogonalize_units(units, whole, orthogonalize)
        for e in self.plain:
            out[id(e)] = torch.stack([done[(id(e), u)] for u in range(e.units)]) if e.stacked else done[(id(e), 0)]
        for key, entries in self.meshes.items():
            out.update(self._exchange(self.mesh_of[key], self.groups[key], entries, local_of, orthogonalize, dtype))
        return [out[id(e)] for e in self.entries]

    def _exchange(self, mesh, group, entries, local_of, orthogonalize, dtype) -> dict[int, torch.Tensor]:
        members = mesh.mesh.flatten().tolist()
        me = members.index(dist.get_rank())
        size = len(members)
        device = local_of[id(entries[0])].device
        # what each owner position owns, in one order every rank knows
        owned = [[(e, u) for e in entries for u in range(e.units) if e.owners[u] == o] for o in range(size)]

        # gather: my pieces of each owner's units, from the ranks of the owner's replica
        send, send_sizes = [], []
        for o in range(size):
            n = 0
            for e, u in owned[o]:
                held = e.held[me]
                if e.slice_key[me] == e.slice_key[o] and u in held:
                    local = local_of[id(e)]
                    send.append((local[held[u]] if e.stacked else local).reshape(-1).to(dtype))
                    n += send[-1].numel()
            send_sizes.append(n)
        recv_sizes = [
            sum(e.piece_numel(s) for e, u in owned[me] if e.slice_key[s] == e.slice_key[me] and u in e.held[s])
            for s in range(size)
        ]
        received = _all_to_all(send, send_sizes, recv_sizes, group, members, dtype, device)
        # assemble my units whole
        full = {}
        for e, u in owned[me]:
            full[(id(e), u)] = torch.empty(tuple(e.param.shape[-2:]), dtype=dtype, device=device)
        for s in range(size):
            chunk = received[s]
            at = 0
            for e, u in owned[me]:
                if e.slice_key[s] == e.slice_key[me] and u in e.held[s]:
                    n = e.piece_numel(s)
                    full[(id(e), u)][e.pieces[s]] = chunk[at : at + n].view(e.piece_shapes[s])
                    at += n
        done = _orthogonalize_units(owned[me], full, orthogonalize)
        # scatter: each rank's piece of every unit I own
        send, send_sizes = [], []
        for r in range(size):
            n = 0
            for e, u in owned[me]:
                if u in e.held[r]:
                    send.append(done[(id(e), u)][e.pieces[r]].reshape(-1))
                    n += send[-1].numel()
            send_sizes.append(n)
        recv_sizes = [sum(e.piece_numel(me) for e, u in owned[o] if u in e.held[me]) for o in range(size)]
        received = _all_to_all(send, send_sizes, recv_sizes, group, members, dtype, device)
        out = {id(e): torch.empty(local_of[id(e)].shape, dtype=dtype, device=device) for e in entries}
        for o in range(size):
            chunk, at = received[o], 0
            for e, u in owned[o]:
                held = e.held[me]
                if u in held:
                    target = out[id(e)][held[u]] if e.stacked else out[id(e)]
                    target.copy_(chunk[at : at + target.numel()].view(target.shape))
                    at += target.numel()
        return out


def _all_to_all(
    send: list[torch.Tensor],
    send_sizes: list[int],
    recv_sizes: list[int],
    group,
    members: list[int],
    dtype: torch.dtype,
    device,
) -> list[torch.Tensor]:
    """One all_to_all_single over `group` (positions: `members`' global ranks) -> the received chunk per position."""
    by_group_rank = sorted(range(len(members)), key=lambda pos: dist.get_group_rank(group, members[pos]))
    # the send buffer in group-rank order
    starts = [0]
    for n in send_sizes:
        starts.append(starts[-1] + n)
    flat = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
    ordered = torch.cat([flat[starts[p] : starts[p + 1]] for p in by_group_rank]) if flat.numel() else flat
    output = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(
        output,
        ordered.contiguous(),
        [recv_sizes[p] for p in by_group_rank],
        [send_sizes[p] for p in by_group_rank],
        group=group,
    )
    chunks, at = {}, 0
    for p in by_group_rank:
        chunks[p] = output[at : at + recv_sizes[p]]
        at += recv_sizes[p]
    return [chunks[p] for p in range(len(members))]


def _orthogonalize_units(
    units: list[tuple[Entry, int]],
    full: dict[tuple[int, int], torch.Tensor],
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
) -> dict[tuple[int, int], torch.Tensor]:
    """Each unit whole ({(id(entry), unit): [A, B]}) -> orthogonalized: the matrices of one shape in one batch."""
    batches: dict[tuple, list[tuple[Entry, int, int]]] = defaultdict(list)  # shape -> (entry, unit, matrices)
    stacks: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for e, u in units:
        m = matrices(e.name, full[(id(e), u)])
        batches[tuple(m.shape[1:])].append((e, u, m.shape[0]))
        stacks[tuple(m.shape[1:])].append(m)
    done = {}
    for shape, members in batches.items():
        result = orthogonalize(torch.cat(stacks[shape]))
        at = 0
        for e, u, k in members:
            done[(id(e), u)] = from_matrices(e.name, result[at : at + k])
            at += k
    return done
