"""torch's underscore ops and module internals titan_fold's layers use, behind public names.

Each is a function that looks the op up when called (so a patched or absent op is seen as torch
has it then), with a `# why:` line: no public equivalent in torch 2.13."""

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake as _is_fake


# why: torch 2.13's grouped GEMM over row groups (offs) exists only as torch._grouped_mm
def grouped_mm(*args, **kwargs) -> torch.Tensor:
    return torch._grouped_mm(*args, **kwargs)


# why: torch 2.13's FP8 grouped GEMM with row-wise scales exists only as torch._scaled_grouped_mm
def scaled_grouped_mm(*args, **kwargs) -> torch.Tensor:
    return torch._scaled_grouped_mm(*args, **kwargs)


# why: whether this torch build has the grouped GEMMs (CPU builds before 2.9 lack torch._grouped_mm)
def has_grouped_mm(scaled: bool = False) -> bool:
    return hasattr(torch, "_scaled_grouped_mm" if scaled else "_grouped_mm")


# why: torch's multi-tensor ops (one launch for a list) are public only inside torch.optim
def foreach_add_(tensors: list[torch.Tensor], other) -> None:
    torch._foreach_add_(tensors, other)


def foreach_sub_(tensors: list[torch.Tensor], other) -> None:
    torch._foreach_sub_(tensors, other)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_copy_(dst, src)


# why: torch 2.13 tells torch.compile a bound of an unbacked size only through torch._check
def check(condition) -> None:
    torch._check(condition)


# why: torch 2.13 has no public torch.compiler form of dynamo's per-tensor marks
def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    torch._dynamo.maybe_mark_dynamic(t, dim)


def mark_static_address(t: torch.Tensor) -> None:
    torch._dynamo.mark_static_address(t, guard=False)


# why: a tensor of FakeTensorMode (dry run, torch.compile's tracing) is told apart only by
# torch._subclasses.fake_tensor.is_fake
def is_fake(t: torch.Tensor) -> bool:
    return _is_fake(t)


# why: nn.Module keeps its hooks in private dicts; a call runs them when any is non-empty
def has_hooks(module: nn.Module) -> bool:
    return bool(
        module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks
    )


# why: a module's own parameters (not its children's), None entries included, are its private dict
def own_parameters(module: nn.Module) -> dict:
    return module._parameters


# why: the private attributes torch.compile (`_orig_mod`), activation checkpointing and FSDP1 wrap
# a module under; they are no part of a parameter's name in the model's state dict
WRAPPER_ATTRIBUTES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
