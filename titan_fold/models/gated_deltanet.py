"""Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE): linear attention whose state is a matrix per head.

Shape letters: b batch, s sequence, H value heads (query/key heads are repeated to H), K key
head dim, V value head dim, n chunks, C chunk length. Per value head, with q_t, k_t l2-normed:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T     S [K, V]; S = 0 before
    o_t = scale * S_t^T q_t                                                each document's first token

The layer: q, k, v, z, b, a = projections of x; q, k, v through a causal depthwise convolution
(kernel 4) and SiLU; beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (a log decay, <= 0);
o = gated delta rule; out = wo(rms_norm(o) * silu(z)). In a packed sample the convolution window
and the state both restart at every document (the positions within each document say where).

`chunk_gated_delta_rule` is the rule on chunks of C tokens (the WY form of DeltaNet): within a
chunk, a triangular solve and matmuls; between chunks, one state update. It is pure torch and
static in shape (compiles with a Python loop over the chunks, unrolled). `gated_delta_rule` picks
fla's kernels with the same contract where they run (models/gdn_fla.py), else this rule.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan_fold.common.tensors import local
from titan_fold.compat.ops import is_fake
from titan_fold.models.gdn_fla import gated_delta_rule as fla_gated_delta_rule
from titan_fold.models.gdn_fla import problem as fla_problem
from titan_fold.models.layers import trunc_normal_

CHUNK = 64


def _segmented_cumsum(g: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """g [..., C] -> sum of g from the latest document start at or before each position (the
    chunk's first position if none) up to it, [..., C]: sums of at most C terms, so exp() of a
    difference of two keeps full precision."""
    total = g.cumsum(-1)
    before = total - g  # exclusive sums
    index = torch.arange(g.shape[-1], device=g.device).expand_as(starts)
    latest = torch.where(starts, index, torch.full_like(index, -1)).cummax(-1).values  # [..., C]
    base = torch.where(latest >= 0, before.gather(-1, latest.clamp(min=0).expand_as(g)), torch.zeros_like(g))
    return total - base


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: torch.Tensor | None = None,
    scale: float | None = None,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The gated delta rule over q, k [b, s, H, K] (l2-normed), v [b, s, H, V], log decay g and
    beta [b, s, H]; starts [b, s] bool (True at each document's first token; None: one document
    per sample). Returns o [b, s, H, V] in v's dtype, computed in float32.

    Within chunk c (positions i, j; gamma the decay summed since the chunk's start or the
    document's start, D_ij = exp(gamma_i - gamma_j) for j <= i in one document, else 0;
    carry_i = 1 while no document started in the chunk up to i):
        T     = (I + strict_lower(beta k k^T * D))^-1
        u     = T (beta v),   w = T (beta k exp(gamma) carry)
        v'    = u - w S                                   the part the state does not predict
        o     = scale (q exp(gamma) carry) S + scale (q k^T * D) v'
        S    <- S exp(gamma_last) carry_last + (k exp(gamma_last - gamma) same_doc_last)^T v'
    """
    b, s, h, dk = q.shape
    dv, dtype = v.shape[-1], v.dtype
    scale = dk**-0.5 if scale is None else scale
    pad = -s % chunk
    n = (s + pad) // chunk
    if starts is None:
        starts = torch.zeros(b, s, dtype=torch.bool, device=q.device)

    def chunks(x: torch.Tensor, fill=0) -> torch.Tensor:  # [b, s, H, d] -> [b, H, n, C, d]
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad), value=fill)
        return x.view(b, n, chunk, h, -1).permute(0, 3, 1, 2, 4)

    q, k, v = chunks(q) * scale, chunks(k), chunks(v)
    g, beta = (chunks(x.unsqueeze(-1)).squeeze(-1) for x in (g, beta))  # [b, H, n, C]
    start = F.pad(starts, (0, pad)).view(b, 1, n, chunk)
    gamma = _segmented_cumsum(g, start.expand_as(g))  # [b, H, n, C]
    segment = start.long().cumsum(-1)  # [b, 1, n, C]: documents started in the chunk so far
    carry = (segment == 0).float()
    same = segment.unsqueeze(-1) == segment.unsqueeze(-2)  # [b, 1, n, C, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # D_ij: masked before exp (gamma_i - gamma_j > 0 above the diagonal may overflow)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~(same & causal), float("-inf")).exp()

    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [b, H, n, C, C]; the unit diagonal is implied
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * (gamma.exp() * carry).unsqueeze(-1), upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay  # [b, H, n, C, C]
    q_read = q * (gamma.exp() * carry).unsqueeze(-1)
    last = gamma[..., -1:]
    # masked before exp: a key of an earlier document has its own decay sum (last - gamma may overflow)
    k_write = k * (last - gamma).masked_fill(~same[..., -1, :], float("-inf")).exp().unsqueeze(-1)
    keep = (last.exp() * carry[..., -1:]).unsqueeze(-1)  # [b, H, n, 1, 1]

    # the scan over chunks, (b, H) flattened: few ops per chunk (a traced or fake step runs each)
    def per_chunk(x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [b, H, n, ...] -> n x [b * H, ...]
        return x.flatten(0, 1).unbind(1)

    state = q.new_zeros(b * h, dk, dv)
    out = []
    chunks_of = zip(*map(per_chunk, (u, w, q_read, scores, keep, k_write.transpose(-1, -2))), strict=True)
    for u_c, w_c, q_c, scores_c, keep_c, k_c in chunks_of:
        v_new = torch.baddbmm(u_c, w_c, state, alpha=-1)  # [b * H, C, V]
        out.append(torch.baddbmm(q_c @ state, scores_c, v_new))
        state = torch.baddbmm(state * keep_c, k_c, v_new)
    o = torch.stack(out, dim=1).view(b, h, n * chunk, dv)[:, :, :s]
    return o.transpose(1, 2).to(dtype)


@torch.library.custom_op("titan_fold::chunk_gated_delta_rule", mutates_args=())
def _rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    return chunk_gated_delta_rule(q, k, v, g, beta, starts, scale)


@_rule.register_fake
def _(q, k, v, g, beta, starts, scale):
    return torch.empty_like(v)


@torch.library.custom_op("titan_fold::chunk_gated_delta_rule_bwd", mutates_args=())
def _rule_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: torch.Tensor | None,
    scale: float,
    do: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule recomputed and differentiated: dq, dk, dv, dg, dbeta (torch.func.vjp: an op's body
    runs beneath autograd). Only fake tensors take this op (gated_delta_rule)."""

    def rule(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, starts, scale)

    _, vjp = torch.func.vjp(rule, q, k, v, g, beta)
    return vjp(do)


@_rule_bwd.register_fake
def _(q, k, v, g, beta, starts, scale, do):
    return tuple(torch.empty_like(t) for t in (q, k, v, g, beta))


def _rule_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.scale = inputs[6]


def _rule_grads(ctx, do):
    *tensors, starts = ctx.saved_tensors
    return *_rule_bwd(*tensors, starts, ctx.scale, do), None, None


_rule.register_autograd(_rule_grads, setup_context=_rule_setup)


def gated_delta_rule(q, k, v, g, beta, starts=None, scale=None) -> torch.Tensor:
    """The rule the layer runs:
    - fla's kernels where they can run this call (models/gdn_fla.py: CUDA, fla-core 0.6
      installed, head dims they serve);
    - else the torch chunked rule, as written; on fake tensors outside a compiled block (the dry
      run's step: shapes and memory only) as one op that keeps its inputs for backward, as fla's
      does, rather than the hundreds of calls of the chunk loop."""
    if fla_problem(q, v) is None:
        return fla_gated_delta_rule(q, k, v, g, beta, starts, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not torch.compiler.is_compiling() and is_fake(q):
        return _rule(q, k, v, g, beta, starts, scale)
    return chunk_gated_delta_rule(q, k, v, g, beta, starts, scale)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 (fla's and transformers' form)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over the sequence, then SiLU: y_t = silu(sum_i w[:, K-1-i]
    x_{t-i}) over the taps i < K that stay within x_t's document. weight [channels, K]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [b, s, channels]; positions [b, s] or [s]: each token's place in its document
        weight = local(self.weight)  # [channels/tp, K] under tensor parallelism
        kernel = weight.shape[-1]
        y = x * weight[:, -1]
        for i in range(1, min(kernel, x.shape[1])):
            shifted = F.pad(x[:, :-i], (0, 0, i, 0))  # x_{t-i}
            inside = (positions >= i).to(x.dtype).unsqueeze(-1)  # [b, s, 1] or [s, 1]
            y = y + shifted * inside * weight[:, -1 - i]
        return F.silu(y)

    def init_weights(self):
        nn.init.uniform_(self.weight, -(self.weight.shape[-1] ** -0.5), self.weight.shape[-1] ** -0.5)


class Decay(nn.Module):
    """g = -exp(A_log) * softplus(a + dt_bias): each value head's log decay per token (<= 0)."""

    def __init__(self, heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        # a [b, s, H] -> g [b, s, H] float32
        A_log, dt_bias = local(self.A_log), local(self.dt_bias)  # [H/tp] under tensor parallelism
        return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())

    def init_weights(self):
        # transformers' init: A uniform in [1, 16], dt_bias 1
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        nn.init.ones_(self.dt_bias)


class GatedRMSNorm(nn.Module):
    """rms_norm(o) * weight * silu(z) over each head's V values (one weight for all heads)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(o.float(), o.shape[-1:], self.weight.float(), self.eps)
        return (normed * F.silu(z.float())).to(o.dtype)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer of Qwen3-Next / Qwen3.5 layers (module docstring).

    q, k, v, z, b, a have a projection each (transformers fuses them: the HF adapter splits
    and joins), and q, k, v a convolution each, so that tensor parallelism shards every one of
    them by heads: a rank holds key heads [r*Hk/tp, ...) and the value heads they serve.
    """

    def __init__(self, args):
        super().__init__()
        dim, nk, nv = args.dim, args.linear_n_key_heads, args.linear_n_value_heads
        dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.dk, self.dv = dk, dv
        self.wq = nn.Linear(dim, nk * dk, bias=False)
        self.wk = nn.Linear(dim, nk * dk, bias=False)
        self.wv = nn.Linear(dim, nv * dv, bias=False)
        self.wz = nn.Linear(dim, nv * dv, bias=False)
        self.wb = nn.Linear(dim, nv, bias=False)
        self.wa = nn.Linear(dim, nv, bias=False)
        self.conv_q = ShortConvolution(nk * dk, args.linear_conv_kernel)
        self.conv_k = ShortConvolution(nk * dk, args.linear_conv_kernel)
        self.conv_v = ShortConvolution(nv * dv, args.linear_conv_kernel)
        self.decay = Decay(nv)
        self.norm = GatedRMSNorm(dv, args.norm_eps)
        self.wo = nn.Linear(nv * dv, dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, mask=None
    ) -> torch.Tensor:
        """x [b, s, dim] -> [b, s, dim], called as every token mixer (cos and sin unused: no RoPE).
        mask: this mixer's document mask, each token's position in its packed document [b, s]
        int64 (None: one document per sample)."""
        b, s, _ = x.shape
        positions = mask
        if positions is None:
            positions = torch.arange(s, device=x.device)
        q = self.conv_q(self.wq(x), positions).view(b, s, -1, self.dk)  # [b, s, Hk, K]
        k = self.conv_k(self.wk(x), positions).view(b, s, -1, self.dk)
        v = self.conv_v(self.wv(x), positions).view(b, s, -1, self.dv)  # [b, s, H, V]
        z = self.wz(x).view(b, s, -1, self.dv)
        beta = self.wb(x).float().sigmoid()  # [b, s, H]
        g = self.decay(self.wa(x))
        groups = v.shape[2] // q.shape[2]  # value heads per key head
        q, k = (l2_normalize(t).repeat_interleave(groups, dim=2) for t in (q, k))  # [b, s, H, K]
        # one document per sample: no starts, so fla's kernels take the batch as it is (no cuts read on the host)
        starts = None if mask is None else (positions == 0).expand(b, s)
        o = gated_delta_rule(q, k, v, g, beta, starts)
        o = self.norm(o, z).to(x.dtype)  # [b, s, H, V]
        return self.wo(o.reshape(b, s, -1))

    def init_weights(self, init_std: float, out_std: float):
        for linear in (self.wq, self.wk, self.wv, self.wz, self.wb, self.wa):
            trunc_normal_(linear.weight, init_std)
        trunc_normal_(self.wo.weight, out_std)
        for conv in (self.conv_q, self.conv_k, self.conv_v):
            conv.init_weights()
        self.decay.init_weights()
        self.norm.reset_parameters()
