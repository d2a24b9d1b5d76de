"""fp32 master weights kept by the optimizer, bf16 weights in the model (Megatron-Core's
precision-aware optimizer).

With `training.dtype = "bfloat16"` the model's parameters are bf16: forward and backward
compute in bf16 with no autocast re-cast of every weight, and the gradients arrive in
bf16. `optimizer.master_weights = true` keeps an fp32 copy of every parameter and fp32
Adam states in the optimizer instead of bf16 ones. Each step reads a parameter's bf16
gradient, updates its fp32 master and moments by torch.optim.Adam / AdamW's algorithm, and
writes the rounded master into the bf16 parameter, in one pass over the parameter (one
generated kernel on CUDA: 28 bytes moved per parameter, where casting the gradients,
running torch's fused AdamW on the masters and copying them back moves 40). So the update
is the fp32 recipe's (updates smaller than a bf16 ulp of the weight accumulate in the
master instead of being rounded away) at bf16 compute speed. Memory per parameter: 2 (bf16
weight) + 2 (bf16 gradient) + 4 (master) + 8 (states) bytes, the fp32 recipe's 16.
Gradients of several micro-batches are summed in bf16 (the model's gradient dtype).

The masters are parameters of the torch optimizers torchtitan builds (their param groups
hold the learning rate its scheduler sets and the settings, their states the moments, and
parallel/clip.py sets their grad_scale: the clip coefficient as a divisor of the gradient,
which the step applies); checkpoints hold them as
`state.<parameter name>.master` next to that parameter's Adam states, in the flattened
layout of `torch.distributed.checkpoint.state_dict` (the keys a run without masters saves,
plus one).
"""

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer import build_optimizers as build_titan_optimizers

from titan_fold.common.config import ConfigError
from titan_fold.common.fused import fused

MASTER_KEY = "master"
# wrapper names (torch.compile, activation checkpointing, FSDP1) that are no part of a
# parameter's name in the model's state dict
_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _fqn(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


class MasterWeightOptimizersContainer(OptimizersContainer):
    """One torch optimizer per model part, over fp32 copies of the part's parameters."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type, optimizer_kwargs: dict[str, Any]):
        self.model_parts = model_parts
        self.optimizers, self.params, self.masters, self.names = [], [], [], []
        for model in model_parts:
            named = [(_fqn(n), p) for n, p in model.named_parameters() if p.requires_grad]
            params = [p for _, p in named]
            masters = [torch.empty_like(p, dtype=torch.float32).copy_(p.detach()) for p in params]
            self.optimizers.append(optimizer_cls(masters, **optimizer_kwargs))
            self.params.append(params)
            self.masters.append(masters)
            self.names.append([n for n, _ in named])
        # per optimizer [lr, 1 / grad_scale] on the device: set without a host sync, and a new
        # learning rate needs no new compile
        self.scalars = [torch.zeros(2, dtype=torch.float32, device=_local(m[0]).device) for m in self.masters]
        # a checkpoint loaded into the model alone (a seed or model-only checkpoint) changes
        # the parameters after this: the masters copy them again at the first step unless a
        # checkpoint of this optimizer was loaded
        self._masters_loaded = False
        self._validate_length(len(model_parts))
        self._post_init([m for masters in self.masters for m in masters], optimizer_kwargs)

    @torch.no_grad()
    def step(self) -> None:
        if not self._masters_loaded:
            self._copy(self.masters, self.params)
            self._masters_loaded = True
        for params, masters, opt, scalars in zip(self.params, self.masters, self.optimizers, self.scalars):
            _init_state(opt)
            group = opt.param_groups[0]
            (beta1, beta2), decoupled = group["betas"], isinstance(opt, torch.optim.AdamW)
            scalars[0].fill_(group["lr"])
            scale = getattr(opt, "grad_scale", None)  # parallel/clip.py's clip coefficient, a divisor
            if scale is None:
                scalars[1].fill_(1.0)
            else:
                scalars[1].copy_(scale.reciprocal())
            for p, m in zip(params, masters):
                if p.grad is None:
                    continue
                state = opt.state[m]
                weight, master, exp_avg, exp_avg_sq = (_local(t).view(-1) for t in (p, m, state["exp_avg"],
                                                                                     state["exp_avg_sq"]))
                fused(_adam_master_step)(weight, _local(p.grad).reshape(-1), master, exp_avg, exp_avg_sq,
                                         state["step"], scalars, beta1, beta2, group["eps"], group["weight_decay"],
                                         decoupled)
                p.grad = None

    def zero_grad(self, *args, **kwargs) -> None:
        for params, opt in zip(self.params, self.optimizers):
            for p in params:
                p.grad = None
            opt.zero_grad(*args, **kwargs)

    @staticmethod
    @torch.no_grad()
    def _copy(dst_parts, src_parts) -> None:
        for dst, src in zip(dst_parts, src_parts):
            torch._foreach_copy_([_local(t) for t in dst], [_local(t) for t in src])

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for names, masters, opt in zip(self.names, self.masters, self.optimizers):
            _init_state(opt)
            hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
            for name, m in zip(names, masters):
                out[f"state.{name}.{MASTER_KEY}"] = m
                for key, value in opt.state[m].items():
                    out[f"state.{name}.{key}"] = value
                for key, value in hyper.items():
                    out[f"param_groups.{name}.{key}"] = value
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for names, masters, opt in zip(self.names, self.masters, self.optimizers):
            _init_state(opt)
            for name, m in zip(names, masters):
                for key, target in [(MASTER_KEY, m), *opt.state[m].items()]:
                    value = state_dict[f"state.{name}.{key}"]
                    if value is not target:
                        target.copy_(value)
            for key in opt.param_groups[0]:
                if key != "params" and names:
                    opt.param_groups[0][key] = state_dict[f"param_groups.{names[0]}.{key}"]
        self._masters_loaded = True
        self._copy(self.params, self.masters)


def _adam_master_step(weight, grad, master, exp_avg, exp_avg_sq, step, scalars, beta1: float, beta2: float,
                      eps: float, weight_decay: float, decoupled: bool) -> None:
    """torch.optim.AdamW's update (decoupled=True; Adam's L2 decay otherwise) of one fp32
    master [n] and its fp32 moments, in place, from the bf16 gradient [n]; the rounded master
    into the bf16 weight [n]. step: the parameter's step count, float32 []; scalars [2]:
    the learning rate and the reciprocal of the clip's grad_scale."""
    lr, inv_scale = scalars[0], scalars[1]
    g = grad.float() * inv_scale
    step.add_(1)
    if decoupled:
        master.mul_(1 - lr * weight_decay)
    else:
        g = g + weight_decay * master
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = exp_avg_sq.sqrt() / (1 - beta2**step).sqrt() + eps
    master.sub_(lr / (1 - beta1**step) * exp_avg / denom)
    weight.copy_(master)


@torch.no_grad()
def _init_state(opt: torch.optim.Optimizer) -> None:
    """Adam's states before its first step (so that a checkpoint has tensors to load into):
    one step with zero gradients and lr 0 moves no parameter; then its moments (which Adam's
    L2 decay did move) go back to zero, and its step count to 0, next to its parameter (the
    master step updates it there)."""
    if all(opt.state.get(p) for group in opt.param_groups for p in group["params"]):
        return
    lrs = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = None
            for value in opt.state[p].values():
                value.zero_()
            opt.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)


def build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None) -> OptimizersContainer:
    """torchtitan's optimizers, or with `optimizer.master_weights` the same optimizer class and
    settings over fp32 masters (TrainSpec.build_optimizers_fn)."""
    optimizers = build_titan_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    if not getattr(optimizer_config, "master_weights", False):
        return optimizers
    if type(optimizers) is not OptimizersContainer:  # config.validate rules out the others but fault tolerance
        raise ConfigError("optimizer.master_weights = true works with the plain optimizer step, not with fault tolerance")
    first = optimizers.optimizers[0]
    kwargs = {k: first.defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "fused", "foreach")}
    return MasterWeightOptimizersContainer(model_parts, type(first), kwargs)
