"""The gated delta rule on CUDA with flash-linear-attention's Triton kernels (fla-core 0.6, the `gdn`
extra: `pip install -e ".[gdn]"`), behind `problem()`; models/gated_deltanet.py's torch chunked rule
runs wherever this cannot, and the banner says why.

Same contract as `chunk_gated_delta_rule`: q, k [b, s, H, K] (l2-normed), v [b, s, H, V], log decay
g and beta [b, s, H], starts [b, s] (True at each document's first token) -> o [b, s, H, V]. Packed
documents become fla's varlen form: the batch flattened to one row, cut at every document start and
every sample start (cu_seqlens).

Forward: fla's `chunk_gated_delta_rule_fwd` as it ships. Backward: fla's kernels in fla's order,
except that the kernel of dq, dk, dw and dg (`chunk_bwd_kernel_dqkwg`) is launched here. fla 0.6
refuses that kernel on Hopper with Triton >= 3.4, < 3.7.1 (fla #640): Triton miscompiles it at a
key block of 64. fla itself picks a block of 128 on Hopper for K = 128, which computes correctly;
the launch below keeps 128 and `problem()` refuses the shapes that would need 64 there. Both ops
are torch custom ops, so torch.compile keeps each as one opaque call (no graph break), and the
varlen cuts, which read the document starts on the host, happen inside them.
"""

import importlib.util
from functools import cache

import torch

FLA_VERSION = "0.6"
CHUNK = 64  # fla's chunk length of the gated delta rule
BLOCK = 128  # the key / value block of chunk_bwd_kernel_dqkwg on Hopper (64 is miscompiled there)


@cache
def _fla_problem() -> str | None:
    if importlib.util.find_spec("fla") is None:
        return 'fla-core is not installed (pip install -e ".[gdn]")'
    from importlib.metadata import version

    found = version("fla-core")
    if not found.startswith(FLA_VERSION + "."):
        return f"fla-core {found} is installed; titan_fold calls the kernels of {FLA_VERSION}"
    return None


def problem(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why fla's kernels cannot run this call of the rule, or None when they can."""
    if q.device.type != "cuda":
        return "fla's kernels need CUDA"
    missing = _fla_problem()
    if missing is not None:
        return missing
    dk, dv = q.shape[-1], v.shape[-1]
    if dk > BLOCK or dv > BLOCK:
        return f"head dims {dk} / {dv}: the backward launch here takes at most {BLOCK}"
    if torch.cuda.get_device_capability(q.device)[0] == 9 and (dk <= BLOCK // 2 or dv <= BLOCK // 2):
        return f"head dims {dk} / {dv}: blocks of 64 in fla's dq/dk kernel are miscompiled on Hopper (fla #640)"
    return None


def _cuts(starts: torch.Tensor | None, b: int, s: int, device: torch.device) -> torch.Tensor | None:
    """cu_seqlens of the flattened batch [1, b * s]: a cut at every sample and document start."""
    if starts is None:
        return None
    first = starts.clone()
    first[:, 0] = True
    at = first.flatten().nonzero().flatten()
    return torch.cat([at, torch.tensor([b * s], device=device)]).to(torch.int32 if b * s < 2**31 else torch.int64)


def _flat(t: torch.Tensor, cuts: torch.Tensor | None) -> torch.Tensor:
    # varlen: fla takes one row of every sample's tokens
    return t.contiguous() if cuts is None else t.reshape(1, -1, *t.shape[2:]).contiguous()


@torch.library.custom_op("titan_fold::gated_delta_rule_fwd", mutates_args=(), device_types="cuda")
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> o [b, s, H, V], the chunk-wise decay sums [b, s, H] and fla's solved matrices A
    [b, s, H, CHUNK] (both saved for the backward)."""
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    from fla.ops.utils.index import prepare_chunk_indices

    b, s = q.shape[:2]
    cuts = _cuts(starts, b, s, q.device)
    indices = None if cuts is None else prepare_chunk_indices(cuts, CHUNK)
    g_sum, o, A, _, _, _ = chunk_gated_delta_rule_fwd(
        *(_flat(t, cuts) for t in (q, k, v, g, beta)),
        scale=scale,
        initial_state=None,
        output_final_state=False,
        cu_seqlens=cuts,
        chunk_indices=indices,
    )
    return o.view(v.shape), g_sum.view(g.shape), A.view(b, s, -1, CHUNK)


@_forward.register_fake
def _(q, k, v, g, beta, starts, scale):
    return torch.empty_like(v), torch.empty_like(g, dtype=torch.float32), k.new_empty(*k.shape[:3], CHUNK)


def _dqkwg(q, k, v_new, w, g, h, dv, do, dh, scale, cuts, indices):
    """fla's chunk_bwd_kernel_dqkwg at blocks of BLOCK (see the module docstring)."""
    import triton
    from fla.ops.common.chunk_o import chunk_bwd_kernel_dqkwg

    B, T, H, K = k.shape
    V = v_new.shape[-1]
    n_chunks = triton.cdiv(T, CHUNK) if cuts is None else len(indices)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    n_key_blocks = triton.cdiv(K, BLOCK)
    dg = g.new_empty(n_key_blocks, *g.shape, dtype=torch.float32)
    dw = torch.empty_like(w)
    chunk_bwd_kernel_dqkwg[(n_key_blocks * n_chunks, B * H)](
        q=q,
        k=k,
        v=v_new,
        g=g,
        g_gamma=None,
        h=h,
        do=do,
        dh=dh,
        dq=dq,
        dk=dk,
        dw=dw,
        dv=dv,
        dg=dg,
        cu_seqlens=cuts,
        chunk_indices=indices,
        scale=scale,
        B=B,
        T=T,
        H=H,
        HV=H,
        K=K,
        V=V,
        BT=CHUNK,
        BK=BLOCK,
        BV=BLOCK,
        STATE_V_FIRST=False,
    )
    return dq, dk, dw, dg.sum(0)


@torch.library.custom_op("titan_fold::gated_delta_rule_bwd", mutates_args=(), device_types="cuda")
def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_sum: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    do: torch.Tensor,
    starts: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq, dk, dv, dbeta, dg, fla's backward with the dq/dk kernel launched by `_dqkwg`."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.index import prepare_chunk_indices

    b, s = q.shape[:2]
    cuts = _cuts(starts, b, s, q.device)
    indices = None if cuts is None else prepare_chunk_indices(cuts, CHUNK)
    q, k, v, g_sum, beta, A, do = (_flat(t, cuts) for t in (q, k, v, g_sum, beta, A, do))
    at = dict(cu_seqlens=cuts, chunk_indices=indices)
    w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g_sum, **at)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g_sum, initial_state=None, **at)
    dv = chunk_bwd_dv_local(q=q, k=k, g=g_sum, do=do, scale=scale, **at)
    dh, _, dv = chunk_gated_delta_rule_bwd_dhu(
        q=q, k=k, w=w, g=g_sum, h0=None, dht=None, do=do, dv=dv, scale=scale, **at
    )
    dq, dk, dw, dg = _dqkwg(q, k, v_new, w, g_sum, h, dv, do, dh, scale, cuts, indices)
    dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g_sum, A=A, dw=dw, du=dv, **at)
    dg = chunk_local_cumsum(dg + dg2, chunk_size=CHUNK, reverse=True, **at)
    shapes = (b, s, *q.shape[2:]), (b, s, *k.shape[2:]), (b, s, *v.shape[2:]), (b, s, -1), (b, s, -1)
    return tuple(t.reshape(shape) for t, shape in zip((dq, dk + dk2, dv, db, dg), shapes, strict=True))


@_backward.register_fake
def _(q, k, v, g_sum, beta, A, do, starts, scale):
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        torch.empty_like(beta),
        torch.empty_like(g_sum),
    )


def _setup(ctx, inputs, output):
    q, k, v, _, beta, starts, scale = inputs
    _, g_sum, A = output
    ctx.save_for_backward(q, k, v, g_sum, beta, A, starts)
    ctx.scale = scale


def _grads(ctx, do, _g_sum_grad, _A_grad):
    q, k, v, g_sum, beta, A, starts = ctx.saved_tensors
    dq, dk, dv, db, dg = _backward(q, k, v, g_sum, beta, A, do.contiguous(), starts, ctx.scale)
    return dq, dk, dv, dg, db, None, None


_forward.register_autograd(_grads, setup_context=_setup)


def gated_delta_rule(q, k, v, g, beta, starts=None, scale=None) -> torch.Tensor:
    """models/gated_deltanet.py's contract on fla's kernels: q, k and beta in v's dtype, g in
    float32 (fla's), o in v's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = v.dtype
    o, _, _ = _forward(q.to(dtype), k.to(dtype), v, g.float(), beta.to(dtype), starts, scale)
    return o
