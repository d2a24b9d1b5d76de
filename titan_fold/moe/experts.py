"""Routed experts as stacked weights, one grouped GEMM for all (local) experts.

Each expert's gate and up projections (HF gate_proj / up_proj, Mixtral w1 / w3) are one
matrix w13 [2 * ffn, dim] whose rows alternate: row 2f is hidden unit f's gate, row 2f + 1
its up projection. So one GEMM of width 2 * ffn computes both (QuACK's gated layout: its
epilogues read the pairs), and any slice of whole pairs is a slice of w13's rows.

The activation of the pairs is one object every path takes (moe/activation.py: SwiGLU, or
GPT-OSS's clamped SwiGLU); with `bias`, each expert adds w13_bias [E, 2 * ffn] to its pairs and
w2_bias [E, dim] to its output (GPT-OSS), the latter times the routing weight like the rest.

Under expert parallelism the module holds only its shard: E/ep experts, ffn/etp of each
expert's width (w13 and w13_bias sliced on their pairs, w2 on its ffn columns). The activation
is elementwise over ffn, so each etp rank computes a partial w2 product that the dispatcher
sums (reduce-scatter); w2_bias is whole on every etp rank and added to the sum once: only where
`adds_w2_bias` (etp rank 0, set by parallel/experts.py). The others add a zero that carries its
gradient, which every etp rank computes in full from the same all-gathered output gradient, so
the replicated bias stays equal. The weights may be plain tensors or DTensors.
"""

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_fold.common.moe_config import ExpertKernels
from titan_fold.common.tensors import local
from titan_fold.compat.ops import grouped_mm, has_grouped_mm, is_fake
from titan_fold.moe.activation import SWIGLU, ExpertActivation
from titan_fold.moe.fp8 import fp8_grouped_linear
from titan_fold.moe.quack import Gather, offsets, quack_experts, use_quack
from titan_fold.moe.wgrad import WgradQueue, flush_at_input, split_grouped_linear

ExpertPath = Literal["split_wgrad", "fp8", "padded", "quack", "torch", "loop"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The experts' dtype for rows x: autocast does not cover grouped GEMMs, so they cast
    rows and weights as it would a matmul."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _grouped_mm_ok(x: torch.Tensor, ffn_dim: int) -> bool:
    # CPU eager takes fp32 and bf16; compiled graphs, fake tensors (the dry run's step) and
    # CUDA take bf16 (the meta kernel's rule); rows must be 16-byte aligned
    if not has_grouped_mm() or (x.shape[-1] * x.element_size()) % 16 or (ffn_dim * x.element_size()) % 16:
        return False
    if x.dtype == torch.bfloat16:
        return True
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(x)


class GroupedExperts(nn.Module):
    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        num_experts: int,
        kernels: ExpertKernels = "auto",
        activation: ExpertActivation = SWIGLU,
        bias: bool = False,
    ):
        super().__init__()
        self.fp8 = kernels == "fp8"  # forward and input-gradient GEMMs in FP8 (moe/fp8.py)
        # the bf16 GEMMs: "torch" | "quack" | "auto" (moe/quack.py); FP8 runs on torch's
        self.grouped_gemm = "torch" if self.fp8 else kernels
        self.activation = activation
        # a WgradQueue: weight gradients computed apart from input gradients (moe/wgrad.py)
        self.wgrad: WgradQueue | None = None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, dim))  # gate, up rows alternating
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim)) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, dim)) if bias else None
        # False on every etp rank but the first: w2_bias is added to the etp sum once
        self.adds_w2_bias = True
        # why QuACK cannot run these experts (None: it can); "auto" then takes torch's GEMMs
        self.quack_problem = activation.quack_problem(bias)

    def _quack(self, x: torch.Tensor, ffn: int) -> bool:
        if self.quack_problem is None:
            return use_quack(self.grouped_gemm, x, ffn)
        if self.grouped_gemm == "quack":
            raise RuntimeError(f"moe.expert_kernels = 'quack' {self.quack_problem}")
        return False

    def fuses_gather(self, x: torch.Tensor) -> bool:
        """Whether forward() reads the routed rows from the tokens x (in the experts' dtype) in place."""
        return self.wgrad is None and not self.fp8 and self._quack(x, local(self.w2).shape[2])

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor | int,
        probs: torch.Tensor,
        prob_before_w2: bool,
        gather: Gather | None = None,
        copies: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [R, dim] rows grouped by local expert; probs [R] routing weight of each row.
        With gather (only where fuses_gather(x)): x [T, dim] tokens, row i reads x[gather.rows[i]].

        counts: [E_local] int tensor of rows per expert, summing to at most R, or an int C
        meaning R = E_local * C (padded, static shapes: batched GEMM). Rows past the last
        group are padding, never computed: torch._grouped_mm and QuACK leave their outputs
        and input gradients uninitialized, so a caller that passes such rows masks both
        (the dispatcher's static exchange).
        copies (moe.hot_expert_replicas): (w [E_local, ...], its name) -> [E_local + copies, ...],
        the weights of the copies this rank runs appended; counts then cover the copies too.
        Returns [R, dim], already multiplied by probs. With etp > 1 it is a partial sum.
        """
        dtype = compute_dtype(x)
        x = x.to(dtype)
        w13, w2 = (local(w).to(dtype) for w in (self.w13, self.w2))
        if copies is not None:
            w13, w2 = copies(w13, "w13"), copies(w2, "w2")
        p = probs.unsqueeze(-1)  # [R, 1], float32 (the router's)
        path = self.path(x, counts, gather, w2.shape[2])
        if path == "quack":
            return quack_experts(x, offsets(counts), w13, w2, probs, prob_before_w2, gather)
        act = _Act(self.activation, *self._row_biases(x, counts, dtype, copies))
        if path == "split_wgrad":
            return _swiglu_split_wgrad(self, x, counts, w13, w2, p, prob_before_w2, act)
        if path == "fp8":
            if isinstance(counts, int):
                counts = torch.full((w13.shape[0],), counts, device=x.device)
            return _swiglu_grouped(x, counts, w13, w2, p, prob_before_w2, act, fp8_grouped_linear)
        if path == "padded":
            y = _swiglu_padded(
                x.view(w13.shape[0], counts, -1), w13, w2, p.view(w13.shape[0], counts, 1), prob_before_w2, act
            )
            return y.flatten(0, 1)
        if path == "torch":
            return _swiglu_grouped(x, counts, w13, w2, p, prob_before_w2, act)
        return _swiglu_loop(x, counts, w13, w2, p, prob_before_w2, act)

    def _row_biases(self, x, counts, dtype, copies) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Each row's w13 and w2 biases ([R, 2 * ffn_local], [R, dim]), or (None, None) without biases."""
        if self.w13_bias is None or self.w2_bias is None:
            return None, None
        b13, b2 = (local(b).to(dtype) for b in (self.w13_bias, self.w2_bias))
        if copies is not None:
            b13, b2 = copies(b13, "w13_bias"), copies(b2, "w2_bias")
        if not self.adds_w2_bias:
            b2 = b2 - b2.detach()  # zero, with the bias's whole gradient
        rows = torch.arange(x.shape[0], device=x.device)
        if isinstance(counts, int):
            expert = rows // counts  # [R]
        else:  # rows past the last group (padding) take the last expert's bias: never read
            ends = counts.cumsum(0)  # [E] end row of each expert
            expert = torch.searchsorted(ends, rows, right=True).clamp(max=b13.shape[0] - 1)
        return b13[expert], b2[expert]

    def path(self, x: torch.Tensor, counts: torch.Tensor | int, gather: Gather | None, ffn: int) -> ExpertPath:
        """Which kernels forward() runs rows x (in the experts' dtype; ffn: this rank's expert width)
        through: the weight gradients apart (split_wgrad), FP8 grouped GEMMs, batched GEMMs over
        equal groups (padded: counts an int), QuACK's grouped GEMMs, torch's, or one GEMM chain per
        expert (loop, the slow fallback). bench/train_step.py counts the answers."""
        if self.wgrad is not None:
            return "split_wgrad"
        if self.fp8:
            return "fp8"
        if isinstance(counts, int):
            return "padded"
        if gather is not None or self._quack(x, ffn):
            return "quack"
        return "torch" if _grouped_mm_ok(x, ffn) else "loop"

    @torch.no_grad()
    def init_weights(self, init_std: float):
        for b in (self.w13_bias, self.w2_bias):
            if b is not None:
                b.zero_()
        for w in (self.w13, self.w2):
            if isinstance(w, DTensor):
                # draw the full tensor and keep our slice: the same values as a one-rank
                # init whatever the (ep, etp) layout
                full = torch.empty(w.shape, dtype=w.dtype, device=w.to_local().device)
                nn.init.trunc_normal_(full, mean=0.0, std=init_std)
                w.to_local().copy_(distribute_tensor(full, w.device_mesh, w.placements, src_data_rank=None).to_local())
            else:
                nn.init.trunc_normal_(w, mean=0.0, std=init_std)


def stack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., ffn, dim] -> w13 [..., 2 * ffn, dim], their rows alternating."""
    return torch.stack([gate, up], dim=-2).flatten(-3, -2)


def split_gate_up(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [..., 2 * ffn, dim] -> gate, up [..., ffn, dim] (strided views): stack_gate_up's inverse."""
    return w13[..., 0::2, :], w13[..., 1::2, :]


class _Act:
    """The activation and this call's per-row biases (b13 [R, 2 * ffn], b2 [R, dim], or None),
    row-sliced alongside x by the per-expert paths."""

    def __init__(self, activation: ExpertActivation, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None):
        self.activation, self.b13, self.b2 = activation, b13, b2

    def rows(self, part: slice) -> "_Act":
        """The same activation over rows `part` only."""
        if self.b13 is None or self.b2 is None:
            return self
        return _Act(self.activation, self.b13[part], self.b2[part])

    def shaped(self, *shape: int) -> "_Act":
        """Biases viewed as [*shape, width] (the padded path's [E, C, ...])."""
        if self.b13 is None or self.b2 is None:
            return self
        return _Act(self.activation, self.b13.view(*shape, -1), self.b2.view(*shape, -1))


_PLAIN = _Act(SWIGLU)  # SwiGLU without biases


def _apply(ab, p, y_fn, prob_before_w2, act: _Act = _PLAIN):
    """ab = x @ w13.T [R, 2 * ffn] (gate, up pairs); p [R, 1] -> y_fn(h) with h = act(gate, up)
    (+ the w2 bias), the probability applied before w2 (the router's gradient then needs only ab,
    saved anyway) or after it."""
    if act.b13 is not None:
        ab = ab + act.b13
    if prob_before_w2:
        y = y_fn(act.activation.pairs(ab, p))
        return y if act.b2 is None else y + act.b2 * p.to(y.dtype)
    y = y_fn(act.activation.pairs(ab))
    if act.b2 is not None:
        y = y + act.b2
    return y * p.to(ab.dtype)


def _swiglu_padded(x, w13, w2, p, prob_before_w2, act=_PLAIN):
    # x [E, C, dim], p [E, C, 1]
    ab = torch.bmm(x, w13.transpose(1, 2))  # [E, C, 2 * ffn]
    return _apply(
        ab, p, lambda h: torch.bmm(h, w2.transpose(1, 2)), prob_before_w2, act.shaped(*x.shape[:2])
    )  # [E, C, dim]


def _bf16_grouped_linear(x, w, offs):
    return grouped_mm(x, w.transpose(1, 2), offs=offs)


def _swiglu_grouped(x, counts, w13, w2, p, prob_before_w2, act=_PLAIN, linear=_bf16_grouped_linear):
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert
    ab = linear(x, w13, offs)  # [R, 2 * ffn]
    return _apply(ab, p, lambda h: linear(h, w2, offs), prob_before_w2, act)


def _swiglu_split_wgrad(experts, x, counts, w13, w2, p, prob_before_w2, act=_PLAIN):
    if isinstance(counts, int):  # padded: groups of C rows
        counts = torch.full((w13.shape[0],), counts, device=x.device)
    if isinstance(experts, FSDPModule):
        # FSDP2 reduce-scatters the unit's gradients when they reach its input
        x, p = flush_at_input(x, experts.wgrad), flush_at_input(p, experts.wgrad)
    quack = not experts.fp8 and experts.quack_problem is None and use_quack(experts.grouped_gemm, x, w2.shape[2])
    return _swiglu_grouped(
        x, counts, w13, w2, p, prob_before_w2, act, split_grouped_linear(experts.wgrad, experts.fp8, quack)
    )


def _swiglu_loop(x, counts, w13, w2, p, prob_before_w2, act=_PLAIN):
    # fallback (float64 tests, no _grouped_mm): one GEMM chain per expert
    if is_fake(x):
        # fake tensors carry no rows per expert to read on the host: one chain over every row
        # keeps for backward what the chains of any split keep
        return _apply(x @ w13[0].T, p, lambda h: h @ w2[0].T, prob_before_w2, act)  # [R, dim]
    sizes = counts.tolist()
    padding = x.shape[0] - sum(sizes)  # rows past the last group: zeros, not computed
    xs, ps = x.split(sizes + [padding]), p.split(sizes + [padding])
    starts = [sum(sizes[:e]) for e in range(len(sizes))]
    ys = [
        _apply(
            xs[e] @ w13[e].T,
            ps[e],
            lambda h, w=w2[e]: h @ w.T,
            prob_before_w2,
            act.rows(slice(starts[e], starts[e] + sizes[e])),
        )  # [n_e, dim]
        for e in range(len(sizes))
    ]
    return torch.cat(ys + [x.new_zeros(padding, w2.shape[1])])
