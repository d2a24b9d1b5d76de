"""Global gradient-norm clipping over parameters that live on different meshes.

Attention parameters are DTensors on the attention mesh, routed experts on the expert
mesh, and one `torch.nn.utils.get_total_norm` cannot mix meshes. Each mesh's norm is
computed on its own (a DTensor reduction over that mesh), the p-th powers are summed, and
pipeline stages are summed over pp. The result equals the one-rank norm.

Applying the clip: torch's clip multiplies every gradient by max_norm / norm, one more
pass over all gradients (its cost: bench/grad_norm.py's record, docs/benchmarks.md). When
the trainer hands its optimizers over and every one is a fused Adam / AdamW, the
multiply is left to them instead: a fused Adam divides each gradient by its
`grad_scale` attribute (the hook GradScaler uses) as it reads it, so setting
grad_scale = norm / max_norm (at least 1) clips inside the optimizer step, at no cost.
"""

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_fold.compat.distributed import flatten_mesh


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
    optimizers: list[torch.optim.Optimizer] | None = None,
    **_torchtitan_kwargs,
) -> torch.Tensor:
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for params in by_mesh.values():
        norms.append(total_norm([p.grad for p in params], norm_type, error_if_nonfinite))
    if not norms:
        return torch.zeros(())
    norms = torch.stack([n.float() for n in norms])
    if math.isinf(norm_type):
        total = norms.max()
        if pp_mesh is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
    else:
        total = (norms**norm_type).sum()
        if pp_mesh is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = total ** (1.0 / norm_type)
    if optimizers and all(divides_by_grad_scale(o) for o in optimizers):
        # the same coefficient as clip_grads_with_norm_, as a divisor
        grad_scale = ((total + 1e-6) / max_norm).clamp(min=1.0)  # []
        for opt in optimizers:
            opt.grad_scale = grad_scale
        return total
    for params in by_mesh.values():
        # one foreach call per mesh, for the same reason as above
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def total_norm(grads: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool = False) -> torch.Tensor:
    """The norm of the gradients of one mesh, in float32 (a plain tensor): one vector_norm per
    tensor, accumulated in float32 (bf16 gradients too), then the norm of those; torch's foreach
    norm (get_total_norm) returns bf16 for bf16 gradients, and is slower (bench/grad_norm.py).
    The 2-norm of the large plain CUDA gradients comes from one Triton launch of partial sums of
    squares per dtype instead (sum_squares.py), which reads them at the memory's rate."""
    large: defaultdict[torch.dtype, list] = defaultdict(list)  # by dtype
    small: list = []
    for g in grads:
        (large[g.dtype] if _summed_by_kernel(g, norm_type) else small).append(g)
    norms = []
    if large:  # queued first: the device reads these while the host queues the small norms
        from titan_fold.parallel import sum_squares

        norms.append(torch.cat([sum_squares.partials(gs) for gs in large.values()]).sum().sqrt())
    norms += [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in small]
    norms = torch.stack(norms)
    if isinstance(norms, DTensor):  # [tensors], partial over the mesh dims the gradients are sharded on
        norms = full_norm(norms, norm_type)
    norm = torch.linalg.vector_norm(norms, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    return norm


# the kernel gives every tensor the same number of programs: the smallest ones (norm weights,
# biases) would leave most of theirs idle, and read too little for the launch to matter
_KERNEL_MIN_NUMEL = 1 << 16


def _summed_by_kernel(g: torch.Tensor, norm_type: float) -> bool:
    return (
        norm_type == 2.0
        and g.is_cuda
        and not isinstance(g, DTensor)
        and g.is_contiguous()
        and g.numel() >= _KERNEL_MIN_NUMEL
        and g.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and g.data_ptr() % g.element_size() == 0
    )


def full_norm(norm: DTensor, norm_type: float) -> torch.Tensor:
    """The value of a DTensor of norms, partial on some mesh dims: one all-reduce over those
    dims together (DTensor's full_tensor would issue one per dim, e.g. over edp then ep)."""
    partial = [name for name, p in zip(norm.device_mesh.mesh_dim_names, norm.placements, strict=True) if p.is_partial()]
    if len(partial) < 2:
        return norm.full_tensor()
    group = flatten_mesh(norm.device_mesh[tuple(partial)]).get_group()
    local = norm.to_local()
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    power = local**norm_type
    dist.all_reduce(power, op=dist.ReduceOp.SUM, group=group)
    return power ** (1.0 / norm_type)


def divides_by_grad_scale(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and all(g.get("fused") for g in opt.param_groups)


@torch.no_grad()
def group_norms(
    tensors: Iterable[tuple[str, torch.Tensor]],
    groups: tuple[str, ...],
    group_of: Callable[[str], str],
    device: torch.device,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """The squared 2-norm of each group's tensors (gradients, updates) over every mesh they live
    on, summed over pp as clip_grad_norm_ sums the total, and how many tensors each group has:
    [2, groups]. `group_of(name)` names a tensor's group. The one all-reduce over pp takes every
    group, so each stage issues the same collective whatever groups it holds."""
    by_group: dict[str, dict[object, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for name, t in tensors:
        by_group[group_of(name)][t.device_mesh if isinstance(t, DTensor) else None].append(t)
    squares = torch.zeros(2, len(groups), device=device)  # [squared norm / tensor count, groups]
    for i, group in enumerate(groups):
        for ts in by_group.get(group, {}).values():  # one norm per mesh, as clip_grad_norm_
            squares[0, i] += total_norm(ts, 2.0).to(device) ** 2
            squares[1, i] += len(ts)
    if pp_mesh is not None:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    return squares


def group_norm_values(squares: torch.Tensor, groups: tuple[str, ...]) -> dict[str, float]:
    """{group: 2-norm} of group_norms' result (on the host), for the groups that have tensors."""
    norms, counts = squares.double().tolist()
    return {g: n**0.5 for g, n, c in zip(groups, norms, counts, strict=True) if c > 0}
