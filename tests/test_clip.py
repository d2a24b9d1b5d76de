"""Gradient clipping: the norm, and the clip applied by the multiply or inside a fused optimizer.

The multi-mesh norm (attention and expert meshes, pp stages) equals the one-rank run's in
every trainer equivalence test (tests/test_equivalence.py, test_pipeline.py); here the
two ways of applying it are checked against torch's own clip on one process.
"""

import os

import pytest
import torch
from helpers import _chunk_sums

from titan_fold.parallel.clip import clip_grad_norm_


def model_with_grads(scale: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    return model


@pytest.mark.parametrize("scale", [1.0, 1e-3])  # clipped, and below max_norm
def test_fused_optimizer_clips_like_the_multiply(scale):
    max_norm = 1.0
    ours, reference = model_with_grads(scale), model_with_grads(scale)
    grads_before = [p.grad.clone() for p in ours.parameters()]

    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    torch.optim.AdamW(reference.parameters(), lr=0.1, fused=True).step()

    opt = torch.optim.AdamW(ours.parameters(), lr=0.1, fused=True)
    norm = clip_grad_norm_(list(ours.parameters()), max_norm, optimizers=[opt])
    torch.testing.assert_close(norm, ref_norm)
    # the gradients are left alone; the optimizer divides by grad_scale as it reads them
    assert all(torch.equal(p.grad, g) for p, g in zip(ours.parameters(), grads_before, strict=True))
    assert opt.grad_scale.item() == pytest.approx(max(1.0, (ref_norm.item() + 1e-6) / max_norm), rel=1e-6)
    opt.step()
    for p, r in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_other_optimizers_get_clipped_gradients():
    max_norm = 1.0
    ours, reference = model_with_grads(1.0), model_with_grads(1.0)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    opt = torch.optim.AdamW(ours.parameters(), lr=0.1, foreach=True)  # no grad_scale support
    clip_grad_norm_(list(ours.parameters()), max_norm, optimizers=[opt])
    assert not hasattr(opt, "grad_scale")
    for p, r in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_total_norm_of_bf16_gradients_is_float32(norm_type):
    """bf16 gradients of very different sizes: their norm, accumulated in float32, against a
    float64 norm of the same values (torch's foreach norm returns a bf16 value here)."""
    from titan_fold.parallel.clip import total_norm

    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=g) * s).bfloat16() for n, s in ((4097, 1e-3), (33, 5.0), (100_000, 1e-2))]
    want = torch.linalg.vector_norm(torch.cat([t.double() for t in grads]), norm_type)
    got = total_norm(grads, norm_type)
    assert got.dtype == torch.float32
    assert abs(got.double() - want) / want < 1e-5  # float32 accumulation; a bf16 result is off by ~1e-3


def test_total_norm_refuses_nonfinite_when_asked():
    from titan_fold.parallel.clip import total_norm

    grads = [torch.ones(3), torch.tensor([1.0, float("nan")])]
    assert torch.isnan(total_norm(grads, 2.0))
    with pytest.raises(RuntimeError, match="non-finite"):
        total_norm(grads, 2.0, error_if_nonfinite=True)


_INTERPRETED = """
import torch
from helpers import _chunk_sums
from titan_fold.parallel import sum_squares

g = torch.Generator().manual_seed(0)
tensors = [torch.randn(n, generator=g).to(dtype) for n, dtype in
           ((70_001, torch.bfloat16), (3 * sum_squares.CHUNK, torch.bfloat16), (100, torch.bfloat16),
            (40_000, torch.bfloat16), (sum_squares.CHUNK + 1, torch.bfloat16))]
parts = sum_squares.partials(tensors).double()
torch.testing.assert_close(parts, _chunk_sums(tensors), rtol=1e-5, atol=1e-12)
print("programs", parts.numel())
"""


@pytest.mark.slow
def test_sum_squares_kernel_in_the_triton_interpreter():
    """The gradient norm's kernel (sum_squares.py) run by Triton's interpreter on the CPU: five
    tensors of one dtype (the binary search over a padded table of eight), each program's
    partial against a float64 sum of squares of its CHUNK elements."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))  # the script imports _chunk_sums from helpers.py here
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED],
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "programs 14" in done.stdout  # ceil(numel / CHUNK) each: 5 + 3 + 1 + 3 + 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the Triton sum of squares runs on CUDA")
def test_total_norm_of_large_cuda_gradients_equals_float64():
    """bf16 and float32 gradients above the kernel's size (sum_squares.py, one launch per dtype)
    beside small ones (vector_norm): the norm against float64, the same bits in a second call,
    and the kernel's partials against float64 sums of squares of each program's chunk."""
    from titan_fold.parallel import sum_squares
    from titan_fold.parallel.clip import _KERNEL_MIN_NUMEL, total_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = (
        (_KERNEL_MIN_NUMEL + 12_345, 1e-3, torch.bfloat16),
        (5_000_011, 2.0, torch.float32),
        (4097, 5.0, torch.bfloat16),
        (7_000_001, 1e-2, torch.bfloat16),
        (_KERNEL_MIN_NUMEL, 0.5, torch.float32),
    )
    grads = [(torch.randn(n, generator=g, device="cuda") * s).to(dtype) for n, s, dtype in sizes]
    want = torch.linalg.vector_norm(torch.cat([t.double() for t in grads]))
    got = total_norm(grads, 2.0)
    assert got.dtype == torch.float32
    assert abs(got.double() - want) / want < 1e-5
    assert torch.equal(total_norm(grads, 2.0), got)

    bf16 = [grads[0], grads[3]]
    parts = sum_squares.partials(bf16).double()  # [programs]: each CHUNK elements of a tensor in turn
    torch.testing.assert_close(parts, _chunk_sums(bf16), rtol=1e-5, atol=1e-12)
