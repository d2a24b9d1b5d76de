"""What a dispatcher learns from the other ranks before it moves rows: the routing of the
other parts of its sequences, the row counts of the expert exchange, and with copies of hot
experts (moe/replicas.py) every source's counts and the copies' weights.

`ExchangedCounts` learns them by collectives over the dispatcher's groups. A dispatcher
holds one as `counts`; whoever builds the layer may hand it another with the same methods
(the dry run's, whose process group returns no values, keeps the collectives and makes up
the values: dryrun/fake_counts.py)."""

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_fold.compat.distributed import funcol
from titan_fold.compat.ops import check
from titan_fold.moe.replicas import copies_of


def gather_even(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """x [n, ...] -> [mesh size * n, ...]: every rank's x, rank-major. No gradient: counts and
    drop decisions."""
    n = mesh.size()
    return funcol.all_to_all_single(x.repeat(n, *[1] * (x.dim() - 1)), None, None, mesh)


def host_rows(n: int, upper: int | None) -> int:
    """A row count read from the device, as torch.compile must know it (an unbacked size)."""
    check(n >= 0)
    if upper is not None:
        check(n <= upper)
    return n


class ExchangedCounts:
    """The other ranks' routing and row counts, by collectives over the dispatcher's groups.
    `dispatcher` is the TokenDispatcher asking (its ep / etp / seq meshes and degrees)."""

    def sequences(self, dispatcher, packed: torch.Tensor) -> torch.Tensor:
        """packed [T, 2k] (probs and expert ids) -> [n * T, 2k]: every seq_mesh rank's, rank-major."""
        return gather_even(packed, dispatcher.seq_mesh)

    def sources(self, dispatcher, counts: torch.Tensor, rows: int) -> torch.Tensor:
        """counts [ep*E_loc]: rows this rank sends each expert -> [etp*ep*E_loc] on the device: rows
        each (etp, ep) source sends each local expert (all-to-all over ep, all-gather over etp).
        rows: this rank's routed rows."""
        d = dispatcher
        recv = funcol.all_to_all_single(counts, None, None, d.ep_mesh) if d.ep > 1 else counts  # [ep*E_loc]
        return gather_even(recv, d.etp_mesh) if d.etp > 1 else recv  # [etp*ep*E_loc]

    def everywhere(self, dispatcher, counts: torch.Tensor) -> torch.Tensor:
        """counts [E]: rows this rank sends each logical expert -> [etp * ep, E]: every source's,
        etp-rank-major (moe.hot_expert_replicas plans from them)."""
        d = dispatcher
        every = gather_even(counts, d.ep_mesh)  # [ep * E]
        every = gather_even(every, d.etp_mesh) if d.etp > 1 else every
        return every.view(-1, counts.numel())

    def copies(self, dispatcher, w: torch.Tensor, nominees: torch.Tensor, name: str) -> torch.Tensor:
        """moe.hot_expert_replicas: w [E_loc, ...] this rank's experts' weight `name` (w13, w2),
        nominees [R] -> [R, ...] the nominees' weights from their home ranks (autograd: the
        copies' gradients go home summed over ep)."""
        return copies_of(w, nominees, dispatcher.ep_mesh)

    def on_host(self, dispatcher, counts: torch.Tensor, gathered: torch.Tensor, rows: int):
        """counts [ep*E_loc] and gathered [etp*ep*E_loc] (sources) on the host, the layer's one
        sync -> (rows sent to each expert, rows each source sends each local expert)."""
        host = [host_rows(c, None) for c in torch.cat([counts, gathered]).tolist()]
        return host[: counts.numel()], host[counts.numel() :]
