"""Tensor helpers every layer of the package uses."""

import torch
from torch.distributed.tensor import DTensor

from titan_fold.compat.distributed import AsyncCollectiveTensor
from titan_fold.compat.ops import WRAPPER_ATTRIBUTES


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (DTensor.to_local, differentiable), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, t itself when it already is. Not t.to(dtype) for the result of an autograd
    Function's forward: traced by torch.compile in torch 2.11, a no-op .to() there aliases the
    returned tensor and its gradient reaches the wrong output (pytorch/pytorch#180642)."""
    return t if t.dtype == dtype else t.to(dtype)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` by a copy queued behind the device's work: a blocking copy (torch's
    default) waits for everything queued before it. The copy reads pinned memory, which the host
    may reuse only once the copy has run (torch's pinned-memory cache keeps track); from pageable
    memory the driver may wait for the device before staging."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result once it has arrived; any other tensor itself."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def model_fqn(name: str) -> str:
    """A parameter or module name without the wrappers of compile and activation checkpointing:
    the name the model's state dict and the placement plan know."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)
