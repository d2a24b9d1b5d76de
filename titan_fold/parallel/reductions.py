"""What every parameter's gradient must go through before the optimizer step, read off the
placement plan alone (no process group, no model):

    expected(placed, layout) -> Expected(grad_dims, norm_dims)

- grad_dims: the mesh dims whose ranks' contributions to this rank's piece of the gradient
  must be summed. The ranks of such a group hold the same piece of the parameter and saw
  different tokens: data parallel (dp_replicate, dp_shard), context parallel (cp: other
  chunks of the same sequences), and tp for a parameter replicated on tp whose gradient is a
  different share on each tp rank (`Placed.tp_partial_grad`: under sequence parallelism the
  norms, router gate and shared_expert_gate see other tokens, Qwen3's q/k norms other heads;
  not a rowwise bias, which sees the whole gradient); for routed experts edp only: the dispatcher has
  already brought every token of the ep x etp group to the expert's owner. A sum, not a
  mean: the loss is divided by the global token count. Pipeline stages share no parameter
  (tied embeddings under PP are refused), so pp is never among them.
- norm_dims: the mesh dims over which the gradient's distinct pieces lie (FSDP's shard
  dim, tp / ep / etp where the placement is a Shard), plus pp: the global gradient norm
  must take each piece's squared norm exactly once, over those ranks, and no replica twice.

`Groups` turns mesh dims into concrete rank sets for any rank and names a rank set by the
dims that make it, the vocabulary the dry run's gradient check (dryrun/gradients.py) prints.
"""

import itertools
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Shard

from titan_fold.parallel.mesh import ATTENTION_DIMS, EXPERT_DIMS, Layout
from titan_fold.parallel.placement import EXPERT, Placed

# the dense FSDP dims, spelled as mesh dims (dp_shard_cp is dp_shard x cp)
_FSDP_DIMS = {"dp_replicate": ("dp_replicate",), "dp_shard_cp": ("dp_shard", "cp"), "edp": ("edp",)}


@dataclass(frozen=True)
class Expected:
    mesh: str  # "attention" or "expert": the mesh both dims below belong to (pp: either)
    grad_dims: tuple[str, ...]
    norm_dims: tuple[str, ...]


def expected(placed: Placed, layout: Layout) -> Expected:
    """The reductions `placed`'s parameter needs under `layout` (see the module docstring)."""
    big = [d for d in (EXPERT_DIMS if placed.mesh == EXPERT else ATTENTION_DIMS) if layout.size(d) > 1]
    sharded = {d for d, p in zip(placed.dims, placed.placements, strict=True) if isinstance(p, Shard)}
    if placed.fsdp_mesh:
        sharded.update(_FSDP_DIMS[placed.fsdp_mesh[-1]])
    if placed.mesh == EXPERT:
        grad = {"edp"}
    else:
        grad = {"dp_replicate", "dp_shard", "cp"} | ({"tp"} if placed.tp_partial_grad else set())
    return Expected(placed.mesh, tuple(d for d in big if d in grad), tuple(d for d in big if d in sharded or d == "pp"))


class Groups:
    """Rank sets of mesh dims over the whole world, from the degrees alone.

    group(rank, mesh, dims): the ranks that differ from `rank` only in `dims` of `mesh`;
    name(rank, ranks): the dims whose group around `rank` is exactly `ranks` (None: no mesh
    group is); closure(rank, groups): the ranks whose contributions reach `rank` through a
    sequence of reductions, each over a group that contains `rank` (a reduce-scatter sums
    its group into each member's shard, an all-reduce into each member's copy)."""

    def __init__(self, layout: Layout):
        self.world = layout.world_size
        self.meshes = {
            "attention": (ATTENTION_DIMS, torch.arange(self.world).reshape([layout.size(d) for d in ATTENTION_DIMS])),
            "expert": (EXPERT_DIMS, torch.arange(self.world).reshape([layout.size(d) for d in EXPERT_DIMS])),
        }
        self.big = {m: tuple(d for d in dims if layout.size(d) > 1) for m, (dims, _) in self.meshes.items()}
        # per instance (one per check), bounded by meshes x dim subsets and ranks
        self._label_cache: dict[tuple[str, tuple[str, ...]], torch.Tensor] = {}
        self._name_cache: dict[tuple[int, str], dict[frozenset[int], tuple[str, tuple[str, ...]]]] = {}

    def _labels(self, mesh: str, dims: tuple[str, ...]) -> torch.Tensor:
        """[world] the id of each rank's group over dims."""
        if (mesh, dims) in self._label_cache:
            return self._label_cache[mesh, dims]
        names, ranks = self.meshes[mesh]
        keep = [names.index(d) for d in dims]
        rest = [i for i in range(ranks.ndim) if i not in keep]
        rows = ranks.permute(*rest, *keep).reshape(-1, math.prod(ranks.shape[i] for i in keep))
        labels = torch.empty(self.world, dtype=torch.int64)
        labels[rows] = torch.arange(rows.shape[0])[:, None]
        self._label_cache[mesh, dims] = labels
        return labels

    def group(self, rank: int, mesh: str, dims: tuple[str, ...]) -> frozenset[int]:
        labels = self._labels(mesh, tuple(dims))
        return frozenset((labels == labels[rank]).nonzero().flatten().tolist())

    def _names(self, rank: int, first: str = "attention") -> dict[frozenset[int], tuple[str, tuple[str, ...]]]:
        if (rank, first) in self._name_cache:
            return self._name_cache[rank, first]
        out: dict = self._name_cache.setdefault((rank, first), {})
        for mesh in sorted(self.meshes, key=lambda m: m != first):  # `first`'s names first, fewest dims first
            for k in range(len(self.big[mesh]) + 1):
                for dims in itertools.combinations(self.big[mesh], k):
                    out.setdefault(self.group(rank, mesh, dims), (mesh, dims))
        return out

    def dims_of(self, rank: int, ranks, mesh: str = "attention") -> tuple[str, tuple[str, ...]] | None:
        return self._names(rank, mesh).get(frozenset(ranks))

    def name(self, rank: int, ranks, mesh: str = "attention") -> str:
        """'dp_shard x tp' (in `mesh`'s dims where it has them), 'none' for the rank alone, or
        the ranks themselves."""
        found = self.dims_of(rank, ranks, mesh)
        if found is None:
            shown = sorted(ranks)
            return (
                "ranks [" + ", ".join(map(str, shown[:8])) + (", ..." if len(shown) > 8 else "") + f"] ({len(shown)})"
            )
        return " x ".join(found[1]) or "none"

    def closure(self, rank: int, groups) -> frozenset[int]:
        reached = torch.zeros(self.world, dtype=torch.bool)
        reached[rank] = True
        for g in groups:
            found = self.dims_of(rank, g)
            if found is None:  # not a mesh group: its members at least
                reached[list(g)] = True
                continue
            labels = self._labels(*found)
            reached = torch.isin(labels, labels[reached])
        return frozenset(reached.nonzero().flatten().tolist())
