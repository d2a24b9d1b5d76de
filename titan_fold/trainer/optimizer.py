"""Adam / AdamW stepped in one pass per parameter, optionally over fp32 master weights kept by
the optimizer with bf16 weights in the model (Megatron-Core's precision-aware optimizer).

The step: `optimizer.implementation = "fused"` (torchtitan's default) runs titan_fold's step,
`_adam_step`: per parameter, one generated kernel on CUDA (torch.compile through fused(); two
where its size is no multiple of `ROW`, see `adam_update`) that reads the gradient, the weight
and the Adam moments once, does torch.optim.Adam / AdamW's math in fp32 and writes the weight
and the moments back in their dtypes. For bf16 parameters that is
the 14 bytes per parameter any Adam step must move, in one pass (torch's fused AdamW moves the
same bytes through multi_tensor_apply; bench/master_step.py times both). The per-parameter
factors (bias corrections, decay, 1 / grad_scale) are computed for all parameters in one small
kernel before (`adam_coefficients`): inside the update each element would recompute them, two
powers and a division, which makes that kernel instruction-bound rather than bandwidth-bound.
The torch optimizers torchtitan builds stay: their param groups hold the learning rate its
scheduler sets and the settings, their states the moments and the step count (a float32 tensor
on the device, as torch's fused Adam keeps it), so state_dict and checkpoints are torchtitan's,
and parallel/clip.py sets their grad_scale (the clip coefficient as a divisor of the gradient,
which the step applies). "foreach" and "for-loop" run torch's own step, and so do
early_step_in_backward and fault tolerance (torchtitan's other containers).

Master weights: with `training.dtype = "bfloat16"` the model's parameters are bf16: forward
and backward compute in bf16 with no autocast re-cast of every weight, and the gradients
arrive in bf16. `optimizer.master_weights = true` keeps an fp32 copy of every parameter and
fp32 Adam states in the optimizer instead of bf16 ones. Each step reads a parameter's bf16
gradient, updates its fp32 master and moments by the same `_adam_step`, and writes the
rounded master into the bf16 parameter, in one pass over the parameter (28 bytes moved per
parameter, where casting the gradients, running torch's fused AdamW on the masters and
copying them back moves 40). So the update is the fp32 recipe's (updates smaller than a bf16
ulp of the weight accumulate in the master instead of being rounded away) at bf16 compute
speed. Memory per parameter: 2 (bf16 weight) + 2 (bf16 gradient) + 4 (master) + 8 (states)
bytes, the fp32 recipe's 16. Gradients of several micro-batches are summed in bf16 (the
model's gradient dtype).

The masters are the parameters of the torch optimizers; checkpoints hold them as
`state.<parameter name>.master` next to that parameter's Adam states, in the flattened
layout of `torch.distributed.checkpoint.state_dict` (the keys a run without masters saves,
plus one).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer import build_optimizers as build_titan_optimizers
from torchtitan.distributed import ParallelDims

from titan_fold.common.config import ConfigError
from titan_fold.common.fused import fused
from titan_fold.common.optimizer_config import Optimizer as OptimizerConfig
from titan_fold.common.tensors import local, model_fqn
from titan_fold.compat.distributed import swap_step
from titan_fold.compat.ops import foreach_add_, foreach_copy_, foreach_sub_
from titan_fold.compat.titan import OptimizersContainerHooks
from titan_fold.parallel.clip import divides_by_grad_scale

MASTER_KEY = "master"
# torch Adam options `_adam_step` does not compute: an optimizer with any of them set steps itself
_TORCH_ONLY = ("amsgrad", "maximize", "capturable", "differentiable")


def steps_in_one_pass(opt: torch.optim.Optimizer) -> bool:
    """Whether `_adam_step` computes what opt.step() would: a fused Adam / AdamW (whose
    clip parallel/clip.py hands over as grad_scale) of one param group of real parameters,
    with none of the options it does not compute."""
    return (
        divides_by_grad_scale(opt)
        and len(opt.param_groups) == 1
        and not any(group.get(key) for group in opt.param_groups for key in _TORCH_ONLY)
        and not any(torch.is_complex(p) for group in opt.param_groups for p in group["params"])
    )


class AdamOptimizersContainer(OptimizersContainerHooks):
    """torchtitan's optimizers (one torch Adam / AdamW per model part), stepped by `_adam_step`
    one parameter at a time; their states, state_dict and load_state_dict are torch's."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type, optimizer_kwargs: dict[str, Any]):
        super().__init__(model_parts, optimizer_cls, optimizer_kwargs)
        # per optimizer, the model's parameters in the order of its param group
        self.params = [list(opt.param_groups[0]["params"]) for opt in self.optimizers]
        self._step_in_one_pass()

    def _step_in_one_pass(self) -> None:
        """Each torch optimizer's step becomes `_update` of it (an instance attribute): the
        container's step (torchtitan's, which runs its hooks once) calls them, and torch's LR
        schedulers, which wrap each optimizer's step to see that it ran, wrap this one."""
        for opt, params in zip(self.optimizers, self.params, strict=True):
            # [lr, 1 / grad_scale] on the device: set without a host sync, and a new learning
            # rate needs no new compile
            scalars = torch.zeros(2, dtype=torch.float32, device=local(params[0]).device)

            # a function, not a partial: the schedulers rebind the method's __func__
            def step(
                opt: torch.optim.Optimizer,
                closure: Callable[[], float] | None = None,
                params: list[torch.Tensor] = params,
                scalars: torch.Tensor = scalars,
            ) -> None:
                _update(opt, params, scalars)

            swap_step(opt, step)


def _update(opt: torch.optim.Optimizer, params: list[torch.Tensor], scalars: torch.Tensor) -> None:
    """One `_adam_step` per parameter of `params` (the model's, in the order of opt's param
    group) with a gradient (torch skips those without). A parameter is updated through its
    master where opt holds one (the optimizer's parameter is then another tensor), in place
    otherwise."""
    # the name torch's own optimizers give their step in a profile
    with torch.no_grad(), torch.profiler.record_function(f"Optimizer.step#{type(opt).__name__}.step"):
        group = opt.param_groups[0]
        (beta1, beta2), decoupled = group["betas"], _decoupled(opt)
        scalars[0].fill_(group["lr"])
        scale = getattr(opt, "grad_scale", None)  # parallel/clip.py's clip coefficient, a divisor
        if scale is None:
            scalars[1].fill_(1.0)
        else:
            scalars[1].copy_(scale.reciprocal())
        # the NaN/Inf guard's verdict (trainer/guard.py), as torch's fused Adam takes it: nonzero
        # leaves the weights, moments and step counts as they were
        found_inf = getattr(opt, "found_inf", None)
        live = [(p, optimized) for p, optimized in zip(params, group["params"], strict=True) if p.grad is not None]
        if not live:
            return
        states = [_state(opt, optimized) for _, optimized in live]
        coefs = adam_coefficients(
            [state["step"] for state in states], scalars, beta1, beta2, group["weight_decay"], found_inf
        )
        hyper = AdamHyper.of_group(group, decoupled)
        for (p, optimized), state, coef in zip(live, states, coefs, strict=True):
            step_parameter(p, optimized, state, coef, hyper, found_inf)


class MasterWeightOptimizersContainer(AdamOptimizersContainer):
    """One torch optimizer per model part, over fp32 copies of the part's parameters."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type, optimizer_kwargs: dict[str, Any]):
        self.model_parts = model_parts
        self.optimizers, self.params, self.masters, self.names = [], [], [], []
        for model in model_parts:
            named = [(model_fqn(n), p) for n, p in model.named_parameters() if p.requires_grad]
            params = [p for _, p in named]
            masters = [torch.empty_like(p, dtype=torch.float32).copy_(p.detach()) for p in params]
            self.optimizers.append(optimizer_cls(masters, **optimizer_kwargs))
            self.params.append(params)
            self.masters.append(masters)
            self.names.append([n for n, _ in named])
        self._step_in_one_pass()
        # a checkpoint loaded into the model alone (a seed or model-only checkpoint) changes
        # the parameters after this: the masters copy them again at the first step unless a
        # checkpoint of this optimizer was loaded
        self._masters_loaded = False
        self.finish_init(len(model_parts), [m for masters in self.masters for m in masters], optimizer_kwargs)

    @torch.no_grad()
    def step(self) -> None:
        if not self._masters_loaded:
            self._copy(self.masters, self.params)
            self._masters_loaded = True
        for opt in self.optimizers:  # not the class's step: it runs the container's hooks, as ours does
            opt.step()
        for params in self.params:  # the bf16 weights hold the update: their gradients are done
            for p in params:
                p.grad = None

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        for params, opt in zip(self.params, self.optimizers, strict=True):
            for p in params:
                p.grad = None
            opt.zero_grad(*args, **kwargs)

    @staticmethod
    @torch.no_grad()
    def _copy(dst_parts: list[list[torch.Tensor]], src_parts: list[list[torch.Tensor]]) -> None:
        for dst, src in zip(dst_parts, src_parts, strict=True):
            foreach_copy_([local(t) for t in dst], [local(t) for t in src])

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for names, masters, opt in zip(self.names, self.masters, self.optimizers, strict=True):
            hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
            for name, m in zip(names, masters, strict=True):
                out[f"state.{name}.{MASTER_KEY}"] = m
                for key, value in _state(opt, m).items():
                    out[f"state.{name}.{key}"] = value
                for key, value in hyper.items():
                    out[f"param_groups.{name}.{key}"] = value
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for names, masters, opt in zip(self.names, self.masters, self.optimizers, strict=True):
            for name, m in zip(names, masters, strict=True):
                for key, target in [(MASTER_KEY, m), *_state(opt, m).items()]:
                    value = state_dict[f"state.{name}.{key}"]
                    if value is not target:
                        target.copy_(value)
            for key in opt.param_groups[0]:
                if key != "params" and names:
                    opt.param_groups[0][key] = state_dict[f"param_groups.{names[0]}.{key}"]
        self._masters_loaded = True
        self._copy(self.params, self.masters)


def adam_coefficients(
    steps: list[torch.Tensor],
    scalars: torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Counts a step of each parameter (steps: their step counts, float32 [] on one device;
    none where found_inf [] is nonzero) and returns each one's `_adam_step` coefficients [4],
    computed once per parameter rather than for every element inside its update. scalars [2]:
    the learning rate and the reciprocal of the clip's grad_scale."""
    foreach_add_(steps, 1)
    coefs = fused(_coefficients)(torch.stack(steps), scalars, beta1, beta2, weight_decay).unbind(0)
    if found_inf is not None:  # torch's fused Adam counts a skipped step and takes it back the same way
        foreach_sub_(steps, [found_inf] * len(steps))
    return coefs


# Elements per row of the [rows, ROW] view `adam_update` steps a parameter's bulk through: a
# multiple of the largest block of a generated elementwise kernel (4096), so its kernel knows its
# size to be a multiple of its block and runs without bounds checks, faster than one for any size
# (the `kernels` suite's master step, bench/results/kernels_*.json).
ROW = 1 << 16


@dataclass(frozen=True)
class AdamHyper:
    """The constants of one Adam / AdamW update (a param group's betas, eps, weight_decay, and
    whether the decay is decoupled: AdamW's, or Adam's L2 term added to the gradient)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool

    @classmethod
    def of_group(cls, group: dict[str, Any], decoupled: bool) -> "AdamHyper":
        (beta1, beta2) = group["betas"]
        return cls(beta1, beta2, group["eps"], group["weight_decay"], decoupled)


def adam_update(
    weight: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    coef: torch.Tensor,
    hyper: AdamHyper,
    found_inf: torch.Tensor | None = None,
) -> None:
    """`_adam_step` of one parameter's flat [n] tensors (master: [n] or None) through fused():
    the first n // ROW * ROW elements viewed [rows, ROW] where that makes two rows or more
    (fused() runs one row op by op, as any size under 2), the rest as they are."""
    tensors, n = (weight, grad, master, exp_avg, exp_avg_sq), weight.numel()
    bulk = n // ROW * ROW if n >= 2 * ROW else 0
    h = hyper
    for step, start, stop, shape in ((_fused_adam_rows, 0, bulk, (-1, ROW)), (_fused_adam_step, bulk, n, (-1,))):
        if stop > start:
            step(
                *(None if t is None else t[start:stop].view(shape) for t in tensors),
                coef,
                h.beta1,
                h.beta2,
                h.eps,
                h.weight_decay,
                h.decoupled,
                found_inf,
            )


def step_parameter(
    p: torch.Tensor,
    optimized: torch.Tensor,
    state: dict[str, Any],
    coef: torch.Tensor,
    hyper: AdamHyper,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adam update of parameter `p` (plain or DTensor) from its gradient and `state`'s
    moments; `optimized` is the optimizer's tensor: `p` itself, or p's fp32 master."""
    master = None if optimized is p else local(optimized).view(-1)
    adam_update(
        local(p).view(-1),
        local(_placed_like(p.grad, p)).reshape(-1),
        master,
        local(state["exp_avg"]).view(-1),
        local(state["exp_avg_sq"]).view(-1),
        coef,
        hyper,
        found_inf,
    )


def _coefficients(
    steps: torch.Tensor, scalars: torch.Tensor, beta1: float, beta2: float, weight_decay: float
) -> torch.Tensor:
    """[n] step counts -> [n, 4]: torch's fused Adam's step size lr / (1 - beta1^t) and
    sqrt(1 - beta2^t), AdamW's decay factor 1 - lr * weight_decay and the gradient's factor
    1 / grad_scale (4 columns: each row 16-byte aligned, as generated kernels assume)."""
    lr, inv_scale = scalars[0], scalars[1]
    step_size = lr / (1 - beta1**steps)
    bias_correction2_sqrt = (1 - beta2**steps).sqrt()
    decay = (1 - lr * weight_decay).expand_as(steps)
    return torch.stack([step_size, bias_correction2_sqrt, decay, inv_scale.expand_as(steps)], dim=1)


def _adam_step(
    weight: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    coef: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    found_inf: torch.Tensor | None = None,
) -> None:
    """torch.optim.AdamW's update (decoupled=True; Adam's L2 decay otherwise) of one parameter
    [n], in place, from its gradient [n] (any float dtype). With a master [n] (fp32) the
    master is updated and rounded into the weight; without one (None) the weight itself, read
    as fp32. The moments [n] are read as fp32 and written back in their dtype; all math is
    fp32, in the order of torch's fused Adam. coef [4]: the parameter's `_coefficients` row.
    found_inf [] (or None): where nonzero, every tensor is written back as it was read."""
    step_size, bias_correction2_sqrt, decay, inv_scale = coef[0], coef[1], coef[2], coef[3]
    w0, m0, v0 = (weight if master is None else master).float(), exp_avg.float(), exp_avg_sq.float()
    w, g = w0, grad.float() * inv_scale
    if decoupled:
        w = w * decay
    else:
        g = g + weight_decay * w
    m = m0.lerp(g, 1 - beta1)
    v = torch.addcmul(v0 * beta2, g, g, value=1 - beta2)
    denom = v.sqrt() / bias_correction2_sqrt + eps
    w = w - step_size * m / denom
    if found_inf is not None:
        keep = found_inf == 0
        w, m, v = torch.where(keep, w, w0), torch.where(keep, m, m0), torch.where(keep, v, v0)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if master is not None:
        master.copy_(w)
    weight.copy_(w)


def _adam_step_rows(*args: Any) -> None:
    """_adam_step over [rows, ROW] views, as a function of its own: torch.compile counts its
    compiles (one per set of dtypes and arguments) against a recompile limit of their own
    instead of doubling _adam_step's."""
    _adam_step(*args)


_fused_adam_step, _fused_adam_rows = fused(_adam_step), fused(_adam_step_rows)


def _placed_like(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """grad with p's placements: a gradient may arrive otherwise placed (e.g. replicated, or
    still partial, for a tp-sharded weight whose gradient hooks did not run), where torch's
    step would redistribute it inside its DTensor ops."""
    if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


def _decoupled(opt: torch.optim.Optimizer) -> bool:
    """AdamW's decay (Adam(decoupled_weight_decay=True) is AdamW) or Adam's L2 decay."""
    return opt.param_groups[0].get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))


def _state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """p's Adam states in opt, made as torch's fused Adam makes them before its first step
    (zero moments like p, in its dtype and layout; step count 0, float32 on p's device) where
    there are none yet: a checkpoint has tensors to load into, and the first step finds them."""
    state = opt.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=local(p).device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def build_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: OptimizerConfig,
    parallel_dims: ParallelDims | None,
    ft_manager: FTManager | None = None,
) -> OptimizersContainer:
    """torchtitan's optimizers, stepped by `_adam_step` where torchtitan builds the plain
    container of fused Adam / AdamW; with `optimizer.master_weights` the same optimizer class
    and settings over fp32 masters (trainer/muon.py's build_optimizers, for TrainSpec)."""
    optimizers = build_titan_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    master_weights = getattr(optimizer_config, "master_weights", False)
    if type(optimizers) is not OptimizersContainer:  # early_step_in_backward, fault tolerance: torchtitan's step
        if master_weights:  # config.validate rules out the others but fault tolerance
            raise ConfigError(
                "optimizer.master_weights = true works with the plain optimizer step, not with fault tolerance"
            )
        return optimizers
    first = optimizers.optimizers[0]
    kwargs = {k: first.defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "fused", "foreach")}
    if master_weights:
        return MasterWeightOptimizersContainer(model_parts, type(first), kwargs)
    if all(steps_in_one_pass(opt) for opt in optimizers.optimizers):
        return AdamOptimizersContainer(model_parts, type(first), kwargs)
    return optimizers
