"""Newton-Schulz on whole matrices of sharded parameters.

Every rank gathers each Muon parameter whole (DTensor's full_tensor over the mesh dims that
shard it), orthogonalizes each of its matrices and keeps its own shard of the result.
"""

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_fold.trainer.muon import from_matrices, matrices


class Orthogonalizer:
    """The orthogonalized updates of the Muon parameters `named` ([(name, parameter)])."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], ns_steps: int):
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]

    def __call__(self, updates: list[torch.Tensor], orthogonalize: Callable[[torch.Tensor], torch.Tensor]
                 ) -> list[torch.Tensor]:
        """updates: each parameter's local update (placed as the parameter) -> its local
        orthogonalized update; orthogonalize: [n, A, B] -> [n, A, B]."""
        out = []
        for name, p, u in zip(self.names, self.params, updates):
            full = u
            if isinstance(p, DTensor):
                full = DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            units = full if full.ndim == 3 else full.unsqueeze(0)
            result = torch.stack([from_matrices(name, orthogonalize(matrices(name, unit))) for unit in units])
            result = result if full.ndim == 3 else result[0]
            if isinstance(p, DTensor):
                result = distribute_tensor(result, p.device_mesh, p.placements, src_data_rank=None).to_local()
            out.append(result)
        return out
