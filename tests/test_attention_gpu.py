"""GPT-OSS's attention variants on FlexAttention (models/attention.py, one GPU) against the math
path in float64: learned sinks, the sliding window, grouped-query heads, causal and over packed
documents whose boundaries fall inside FlexAttention's blocks; the output and the gradients of q,
k, v and the sinks, eager and under torch.compile."""

import pytest
import torch

from titan_fold.models.attention import attend, sink_attention
from titan_fold.models.documents import document_mask

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: FlexAttention's kernels are CUDA only")

B, S, HEADS, KV_HEADS, D = 2, 512, 8, 2, 64
# document starts of the packed case, per sample (a one-token document at 300)
STARTS = ((0, 100, 300, 301), (0, 200, 455))


def _document_ids() -> torch.Tensor:
    ids = torch.zeros(B, S, dtype=torch.long)
    for row, starts in enumerate(STARTS):
        for n, at in enumerate(starts):
            ids[row, at:] = n
    return ids


def _allowed(ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [b, 1, s, s]: same document, causal, within the window."""
    pos = torch.arange(S)
    delta = pos[:, None] - pos[None, :]
    allowed = (ids[:, :, None] == ids[:, None, :]) & (delta >= 0)
    if window is not None:
        allowed &= delta < window
    return allowed.unsqueeze(1)


@GPU
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("window", [None, 128], ids=["full", "window128"])
def test_flex_sinks_match_the_math_path(window, documents, compiled):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, S, D, generator=gen)
    k, v = (torch.randn(B, KV_HEADS, S, D, generator=gen) for _ in "kv")
    sinks = torch.randn(HEADS, generator=gen)
    weight = torch.randn(B, HEADS, S, D, generator=gen)  # the loss: sum(out * weight)
    ids = _document_ids() if documents else torch.zeros(B, S, dtype=torch.long)

    ref_inputs = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ref = sink_attention(*ref_inputs[:3], _allowed(ids, window), ref_inputs[3])
    (ref * weight.double()).sum().backward()

    inputs = [t.cuda().requires_grad_() for t in (q, k, v, sinks)]
    mask = document_mask(ids.cuda(), window=window) if documents else None
    fn = torch.compile(attend, fullgraph=True) if compiled else attend
    out = fn(*inputs[:3], mask=mask, sinks=inputs[3], window=None if documents else window)
    (out * weight.cuda()).sum().backward()

    # FlexAttention's fp32 matmuls may run in TF32 on Hopper
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double().cpu(), ref, **tol)
    for name, got, want in zip("q k v sinks".split(), inputs, ref_inputs, strict=True):
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, **tol, msg=f"grad of {name}")
