"""Muon for the hidden matrices, AdamW for the rest (`optimizer.name = "Muon"`), as Moonlight
trains them.

Muon's update of a matrix W [A, B] with gradient G: the momentum M = mu M + (1 - mu) G (torch's
lerp form), the update U = G + mu (M - G) with Nesterov, else M; U orthogonalized
by Newton-Schulz iterations (`newton_schulz`, parallel/orthogonalize.py), then W = W (1 - lr wd) - lr s O, with s =
0.2 sqrt(max(A, B)) ("match_rms_adamw": the update's RMS that of AdamW's, so lr and weight decay
tuned for AdamW carry over) or sqrt(max(1, A / B)) ("original"). torch.optim.Muon computes the
same for one matrix.

Which parameters are matrices (models/groups.py, `MUON_RULES`): the attention projections (MLA's
too), the dense FFN, the shared expert and the routed experts, each expert's matrices on their own
(w13 [E, 2 * ffn, dim] is a stack of E experts, each of a gate and an up matrix [ffn, dim] whose
rows alternate; w2 [E, dim, ffn] of E matrices), and MTP's projection. AdamW keeps the embedding,
the head, the norms, the router, the shared expert's gate and every bias.

Newton-Schulz needs a whole matrix, where the folding leaves each rank a shard:
parallel/orthogonalize.py gathers every matrix on one owner rank, orthogonalizes it there and
sends the shards back.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims

from titan_fold.common.config import ConfigError
from titan_fold.common.optimizer_config import Optimizer as OptimizerConfig
from titan_fold.common.tensors import local, model_fqn
from titan_fold.compat.titan import OptimizersContainerHooks
from titan_fold.models.groups import matrix_shape, parameter_group, uses_muon
from titan_fold.parallel.orthogonalize import Orthogonalizer, newton_schulz
from titan_fold.trainer.optimizer import AdamHyper, _placed_like, _state, adam_coefficients, step_parameter
from titan_fold.trainer.optimizer import build_optimizers as build_adam_optimizers


def update_scale(shape: tuple[int, int], lr_adjust: str) -> float:
    """The factor of lr on an orthogonalized update of a matrix [A, B]."""
    a, b = shape
    return 0.2 * math.sqrt(max(a, b)) if lr_adjust == "match_rms_adamw" else math.sqrt(max(1.0, a / b))


# torch.optim.Muon's: the smallest norm Newton-Schulz divides by
NS_EPS = 1e-7
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Muon(torch.optim.Optimizer):
    """Muon's update for the matrices (param group 0, "muon": True) and AdamW's for the other
    parameters (group 1); both groups take the scheduler's lr and the decay. State: a
    "momentum_buffer" per matrix, "step", "exp_avg", "exp_avg_sq" per other parameter."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.Tensor]],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_coefficients: tuple[float, float, float],
        ns_steps: int,
        lr_adjust: str,
        ns_dtype: str,
    ):
        self.names = {id(p): name for name, p in named_params}
        muon = [p for name, p in named_params if uses_muon(name, p)]
        adam = [p for name, p in named_params if not uses_muon(name, p)]
        groups = [{"params": muon, "muon": True}, {"params": adam, "muon": False}]
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            ns_steps=ns_steps,
            lr_adjust=lr_adjust,
            ns_dtype=ns_dtype,
        )
        super().__init__(groups, defaults)
        self._orthogonalizer: Orthogonalizer | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        for group in self.param_groups:
            (self._muon_step if group["muon"] else self._adamw_step)(group)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        live = [p for p in group["params"] if p.grad is not None]
        if not live:
            return
        beta1, beta2 = group["betas"]
        states = [_state(self, p) for p in live]
        scalars = torch.tensor([group["lr"], 1.0], dtype=torch.float32, device=local(live[0]).device)
        coefs = adam_coefficients([s["step"] for s in states], scalars, beta1, beta2, group["weight_decay"])
        hyper = AdamHyper.of_group(group, decoupled=True)
        for p, state, coef in zip(live, states, coefs, strict=True):
            step_parameter(p, p, state, coef, hyper)

    def _muon_step(self, group: dict[str, Any]) -> None:
        params = group["params"]
        if not any(p.grad is not None for p in params):
            return
        momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        dtype = DTYPES[group["ns_dtype"]]
        updates = []
        for p in params:
            # a parameter without a gradient is skipped, as torch skips it, but its (zero) update
            # still takes part in the exchanges: every rank of a mesh runs the same ones
            if p.grad is None:
                updates.append(torch.zeros_like(local(p)))
                continue
            grad = local(_placed_like(p.grad, p))
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
        if self._orthogonalizer is None:
            self._orthogonalizer = Orthogonalizer([(self.names[id(p)], p) for p in params], group["ns_steps"])

        def orthogonalize(stack: torch.Tensor) -> torch.Tensor:  # [n, A, B] -> the same, orthogonalized
            return newton_schulz(stack, group["ns_coefficients"], group["ns_steps"], NS_EPS, dtype)

        for p, out in zip(params, self._orthogonalizer(updates, orthogonalize, dtype), strict=True):
            if p.grad is None:
                continue
            scale = update_scale(matrix_shape(self.names[id(p)], p.shape), group["lr_adjust"])
            w = local(p)
            w.mul_(1 - lr * decay)
            w.add_(out.to(w.dtype), alpha=-lr * scale)


class MuonOptimizersContainer(OptimizersContainerHooks):
    """torchtitan's container of one optimizer per model part, each a `Muon` over the part's
    named parameters; torchtitan's state_dict (flattened, by parameter name) and hooks."""

    def __init__(self, model_parts: list[nn.Module], optimizer_kwargs: dict[str, Any]):
        self.model_parts = model_parts
        self.optimizers, all_params = [], []
        for model in model_parts:
            named = [(model_fqn(n), p) for n, p in model.named_parameters() if p.requires_grad]
            self.optimizers.append(Muon(named, **optimizer_kwargs))
            all_params += [p for _, p in named]
        self.finish_init(len(model_parts), all_params, optimizer_kwargs)

    def split(self) -> str:
        """One line: how many parameters (and elements) each update takes, by parameter group."""
        counts: dict[str, dict[str, int]] = {"muon": {}, "adamw": {}}
        sizes = {"muon": 0, "adamw": 0}
        for opt in self.optimizers:
            for group in opt.param_groups:
                kind = "muon" if group["muon"] else "adamw"
                for p in group["params"]:
                    name = parameter_group(opt.names[id(p)])
                    counts[kind][name] = counts[kind].get(name, 0) + 1
                    sizes[kind] += p.numel()
        return "; ".join(
            f"{kind} {sizes[kind] / 1e6:.2f}M params: "
            + ", ".join(f"{group} {n}" for group, n in sorted(counts[kind].items()))
            for kind in ("muon", "adamw")
        )


def muon_kwargs(optimizer_config: OptimizerConfig) -> dict[str, Any]:
    c = optimizer_config
    return dict(
        lr=c.lr,
        betas=(c.beta1, c.beta2),
        eps=c.eps,
        weight_decay=c.weight_decay,
        momentum=c.muon_momentum,
        nesterov=c.muon_nesterov,
        ns_coefficients=tuple(c.muon_ns_coefficients),
        ns_steps=c.muon_ns_steps,
        lr_adjust=c.muon_lr_adjust,
        ns_dtype=c.muon_ns_dtype,
    )


def build_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: OptimizerConfig,
    parallel_dims: ParallelDims | None,
    ft_manager: FTManager | None = None,
) -> OptimizersContainer:
    """TrainSpec.build_optimizers_fn: with `optimizer.name = "Muon"` a MuonOptimizersContainer,
    else trainer/optimizer.py's Adam / AdamW."""
    if optimizer_config.name != "Muon":
        return build_adam_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    if ft_manager is not None and ft_manager.enabled:
        raise ConfigError("optimizer.name = 'Muon' works with the plain optimizer step, not with fault tolerance")
    return MuonOptimizersContainer(model_parts, muon_kwargs(optimizer_config))
