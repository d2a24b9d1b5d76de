"""Tensor helpers every layer of the package uses."""

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (DTensor.to_local, differentiable), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, t itself when it already is. Not t.to(dtype) for the result of an autograd
    Function's forward: traced by torch.compile in torch 2.11, a no-op .to() there aliases the
    returned tensor and its gradient reaches the wrong output (pytorch/pytorch#180642)."""
    return t if t.dtype == dtype else t.to(dtype)
