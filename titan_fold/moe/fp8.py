"""FP8 routed experts (`moe.expert_kernels = "fp8"`): rowwise-scaled float8 grouped GEMMs.

Each grouped GEMM y = x @ w[e].T of the experts runs forward and input-gradient in
float8_e4m3fn with one fp32 scale per row of each operand along the contracted dimension
(torch._scaled_grouped_mm, bf16 out), as torchao's rowwise MoE recipe: rows of x (and of
the output gradient) by their amax, and the weight per (expert, output row) forward, per
(expert, input column) for the input gradient, so it is quantized twice. The weight
gradient stays a bf16 grouped GEMM: its contraction runs over each expert's rows, so a
rowwise FP8 version needs scales per expert and column of a jagged operand (a quantizing
kernel of its own), for a third of the GEMM work.

On the CPU the scaled GEMM is emulated from the dequantized operands (tests); the trainer
refuses the option there (`fp8_problem`).
"""

import torch

from titan_fold.compat.ops import grouped_mm as compat_grouped_mm
from titan_fold.compat.ops import has_grouped_mm
from titan_fold.compat.ops import scaled_grouped_mm as compat_scaled_grouped_mm

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# the scaled grouped GEMM wants 16-byte rows of fp8 operands
ALIGN = 16


def fp8_problem(dim: int, ffn_local: int, capability: tuple[int, int] | None) -> str | None:
    """Why FP8 experts cannot run here (a rule for the config error), or None."""
    if capability is None:
        return "needs a CUDA GPU"
    if capability < (9, 0) or not has_grouped_mm(scaled=True):
        return f"needs an sm90 (Hopper) GPU or newer with torch._scaled_grouped_mm; this GPU is sm{capability[0]}{capability[1]}"
    if dim % ALIGN or ffn_local % ALIGN:
        return (
            f"the model width ({dim}) and each expert's width per etp rank ({ffn_local}) must be multiples of {ALIGN}"
        )
    return None


def _quantize_ref(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # torch ops (CPU; and the definition the kernels follow)
    s = torch.linalg.vector_norm(t, float("inf"), dim=-1).float().clamp(min=1e-12) / FP8_MAX
    q = (t.float() / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
    return q, s


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [..., K] -> (q [..., K] float8_e4m3fn contiguous, s [...] fp32) with t ~ q * s: one
    scale per row, amax(|row|) mapped to the largest fp8 value. On CUDA one Triton kernel reads
    t once (rows of a contiguous t; for w.transpose(1, 2) of a contiguous [E, N, K] w, tiles of
    w, written transposed). Generated kernels (torch.compile of these ops) ran 3-5x under the
    memory bandwidth: one shape per call site needs dynamic widths, whose index arithmetic
    divides by runtime values (docs/benchmarks.md)."""
    return _quantize_cuda(t) if t.is_cuda else _quantize_ref(t)


@torch.library.custom_op("titan_fold::fp8_quantize", mutates_args=())
def _quantize_cuda(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # an op of its own: torch.compile neither traces the Triton launch nor changes t's layout
    import titan_fold.moe.fp8_kernels as fp8_kernels

    if t.is_contiguous():
        return fp8_kernels.quantize_rows(t)
    if t.dim() == 3 and t.transpose(1, 2).is_contiguous():
        return fp8_kernels.quantize_columns(t.transpose(1, 2))
    return fp8_kernels.quantize_rows(t.contiguous())


@_quantize_cuda.register_fake
def _(t):
    return t.new_empty(t.shape, dtype=FP8), t.new_empty(t.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("titan_fold::scaled_grouped_mm", mutates_args=())
def _scaled_grouped_mm_cuda(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # an op of its own, so that torch.compile passes the operands in these layouts: A row-major,
    # B as [E, K, N] column-major (the transpose of the contiguous [E, N, K])
    return compat_scaled_grouped_mm(
        a_q, b_q.transpose(-2, -1), a_s, b_s, offs=offs, out_dtype=out_dtype, use_fast_accum=True
    )


@_scaled_grouped_mm_cuda.register_fake
def _(a_q, a_s, b_q, b_s, offs, out_dtype):
    return a_q.new_empty(a_q.shape[0], b_q.shape[1], dtype=out_dtype)


@torch.library.custom_op("titan_fold::grouped_weight_grad", mutates_args=())
def _weight_grad_cuda(g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # g.T as a column-major view: the groups run along its strided dimension (a compiled graph
    # that made it row-major would need 16-byte aligned groups)
    return compat_grouped_mm(g.t(), x, offs=offs)


@_weight_grad_cuda.register_fake
def _(g, x, offs):
    return g.new_empty(offs.shape[0], g.shape[1], x.shape[1])


def scaled_grouped_mm(a_q, a_s, b_q, b_s, offs, out_dtype) -> torch.Tensor:
    """a_q [M, K], a_s [M]; b_q [E, N, K], b_s [E, N]; offs [E] end rows of the groups of a
    -> [M, N] with rows of group e = (a * a_s) @ (b[e] * b_s[e]).T, in out_dtype."""
    if a_q.is_cuda:
        return _scaled_grouped_mm_cuda(a_q, a_s, b_q, b_s, offs, out_dtype)
    a = a_q.float() * a_s[:, None]
    b = b_q.float() * b_s[..., None]
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[e].T
        start = end
    return out.to(out_dtype)


def _weight_grad(g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # g [M, N], x [M, K] -> [E, N, K], group e: g[rows of e].T @ x[rows of e]
    if g.is_cuda:
        return _weight_grad_cuda(g, x.contiguous(), offs)
    if g.dtype == torch.float32:
        return compat_grouped_mm(g.t(), x, offs=offs)
    out, start = [], 0
    for end in offs.tolist():
        out.append(g[start:end].T @ x[start:end])
        start = end
    return torch.stack(out)


class _FP8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, defer_wgrad):
        ctx.save_for_backward(x, w, offs)
        ctx.defer_wgrad = defer_wgrad
        x_q, x_s = quantize(x)
        w_q, w_s = quantize(w)  # per (expert, output row), amax over the input width
        return scaled_grouped_mm(x_q, x_s, w_q, w_s, offs, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        g_q, g_s = quantize(grad)
        wt_q, wt_s = quantize(w.transpose(1, 2))  # per (expert, input column), amax over the output rows
        grad_x = scaled_grouped_mm(g_q, g_s, wt_q, wt_s, offs, x.dtype)
        if ctx.defer_wgrad is not None:  # moe/wgrad.py computes it later
            ctx.defer_wgrad(grad, x, offs)
            return grad_x, None, None, None
        return grad_x, _weight_grad(grad, x, offs).to(w.dtype), None, None


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, defer_wgrad=None) -> torch.Tensor:
    """x [M, K] rows grouped by expert, w [E, N, K], offs [E] int32 end rows -> x @ w[e].T per
    group [M, N], forward and input gradient in FP8, weight gradient in x's dtype.
    defer_wgrad(grad, x, offs): takes the weight gradient's operands instead of computing it."""
    return _FP8GroupedLinear.apply(x, w, offs, defer_wgrad)
