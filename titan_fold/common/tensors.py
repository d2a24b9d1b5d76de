"""Tensor helpers every layer of the package uses."""

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (DTensor.to_local, differentiable), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
