"""FP8 routed experts (titan_fold/moe/fp8.py): the rowwise quantization, the grouped GEMM
and its gradients against float64 references, and the config rules.

On the CPU the scaled GEMM is emulated from the dequantized operands; the references here
quantize independently in float64 (one scale per row along the contracted dimension), so a
wrong scale axis, a missing transpose or a scale applied as its inverse fails. The rows and
weight rows span many orders of magnitude: one scale per tensor (or along the wrong axis)
would round the small rows to zero. On an sm90 GPU the same checks run on
torch._scaled_grouped_mm.
"""

import pytest
import torch

from titan_fold.common.config import ConfigError, parse_args
from titan_fold.moe import MoE, MoEArgs
from titan_fold.moe.fp8 import FP8, FP8_MAX, fp8_grouped_linear, fp8_problem, quantize

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0) else [])


def _ref_quant(t: torch.Tensor) -> torch.Tensor:
    """float64 fake quantization, one scale per row of the last dim (amax -> 448)."""
    t = t.double()
    s = t.abs().amax(-1, keepdim=True) / 448.0
    return (t / s).to(torch.float8_e4m3fn).double() * s


def _grouped(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    # rows of group e: a_e @ b[e].T
    return torch.cat([ae @ b[e].T for e, ae in enumerate(a.split(sizes))])


def _case(device, dtype, m_sizes=(7, 0, 25, 16), k=48, n=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, m = len(m_sizes), sum(m_sizes)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 3, m)[torch.randperm(m, generator=g)][:, None]
    w = torch.randn(e, n, k, generator=g) * torch.logspace(-5, 2, n)[None, :, None]
    w = w * torch.logspace(-3, 3, k)[None, None, torch.randperm(k, generator=g)]  # input columns differ too
    grad = torch.randn(m, n, generator=g) * torch.logspace(-4, 4, m)[:, None]
    offs = torch.tensor(m_sizes).cumsum(0).to(torch.int32)
    return [t.to(device) for t in (x.to(dtype), w.to(dtype), grad.to(dtype), offs)], list(m_sizes)


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_rowwise(device):
    (x, w, _, _), _ = _case(device, torch.float32)
    for t in (x, w, w.transpose(1, 2)):
        q, s = quantize(t)
        assert q.dtype == FP8 and q.is_contiguous() and s.dtype == torch.float32 and s.shape == t.shape[:-1]
        # every row's largest value lands on the largest fp8 value, and q * s is the float64 quantization
        assert torch.equal(q.float().abs().amax(-1), torch.full_like(s, FP8_MAX))
        deq = q.double() * s.double()[..., None]
        torch.testing.assert_close(deq, _ref_quant(t), rtol=1e-6, atol=0)
        # e4m3 keeps 3 mantissa bits: each value within 2^-4 of itself, relative to its row's scale
        assert ((deq - t.double()).abs() <= t.double().abs() * 2**-4 + s.double()[..., None] * 2**-9).all()


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_and_grads_against_float64(device):
    # bf16 on the GPU (the scaled GEMM's operands), float32 on the CPU emulation
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    (x, w, grad, offs), sizes = _case(device, dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = fp8_grouped_linear(x, w, offs)
    y.backward(grad)
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype
    xd, wd, gd = x.detach().double(), w.detach().double(), grad.double()
    out_tol = dict(rtol=2e-2, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=0)

    def close(actual, expected, rtol):
        # per row: the error against the row's norm (rows span many orders of magnitude)
        err = (actual.double() - expected).norm(dim=-1) / expected.norm(dim=-1).clamp(min=1e-300)
        assert (err[expected.norm(dim=-1) > 0] < rtol).all(), err.max()

    # forward: exactly the float64 product of the rowwise-quantized operands ...
    close(y, _grouped(_ref_quant(xd), _ref_quant(wd), sizes), out_tol["rtol"])
    # ... and within FP8's error of the unquantized product
    close(y, _grouped(xd, wd, sizes), 0.2)
    # input gradient: grad quantized per row over N, w per (expert, input column) over N
    wt = _ref_quant(wd.transpose(1, 2))  # [E, K, N]
    close(x.grad, _grouped(_ref_quant(gd), wt, sizes), out_tol["rtol"])
    close(x.grad, _grouped(gd, wd.transpose(1, 2), sizes), 0.2)
    # weight gradient: unquantized, g_e.T @ x_e
    ref_w = torch.stack([ge.T @ xe for ge, xe in zip(gd.split(sizes), xd.split(sizes), strict=True)])
    close(w.grad.flatten(0, 1), ref_w.flatten(0, 1), 2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_moe_layer_fp8_close_to_bf16():
    # the whole layer on the CPU emulation: FP8 experts within FP8's error of the same layer without
    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=2, moe_ffn_dim=32)
    layers = []
    for fp8 in (False, True):
        torch.manual_seed(0)
        layer = MoE(64, MoEArgs(**{**args.__dict__, "expert_kernels": "fp8" if fp8 else "auto"}))
        layer.init_weights(0.02)
        layers.append(layer)
    x = torch.randn(2, 16, 64)
    ys = [layer(x) for layer in layers]
    err = (ys[1] - ys[0]).norm() / ys[0].norm()
    assert 0 < err < 0.1
    for y in ys:
        y.square().sum().backward()
    for name in ("w13", "w2"):
        a, b = (getattr(layer.experts, name).grad for layer in layers)
        assert (b - a).norm() / a.norm() < 0.1


def test_fp8_rules():
    assert fp8_problem(2048, 768, None) == "needs a CUDA GPU"
    assert "sm80" in fp8_problem(2048, 768, (8, 0))
    assert "multiples of 16" in fp8_problem(2048, 760, (9, 0))
    assert fp8_problem(2048, 768, (9, 0)) is None
    with pytest.raises(
        ConfigError,
        match=r"^moe.expert_kernels = 'fp8' with training.dtype = 'float32' and "
        r"training.mixed_precision_param = 'float32'",
    ):
        parse_args(
            [
                "--job.config_file",
                "debug_moe.toml",
                "--moe.expert_kernels",
                "fp8",
                "--training.mixed_precision_param",
                "float32",
            ]
        )


def test_trainer_refuses_fp8_without_gpu(monkeypatch):
    from titan_fold.trainer.preflight import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine checks the CPU's refusal too

    config = parse_args(
        [
            "--job.config_file",
            "debug_moe.toml",
            "--moe.expert_kernels",
            "fp8",
            "--training.mixed_precision_param",
            "bfloat16",
        ]
    )
    with pytest.raises(ConfigError, match=r"^moe.expert_kernels = 'fp8': needs a CUDA GPU$"):
        preflight(config, 1)


def test_dry_run_checks_only_the_shapes():
    # a dry run plans for the real GPUs: no device rule on its host, the width rule still
    from titan_fold.trainer.preflight import preflight

    base = [
        "--job.config_file",
        "debug_moe.toml",
        "--moe.expert_kernels",
        "fp8",
        "--training.mixed_precision_param",
        "bfloat16",
        "--comm.mode",
        "fake_backend",
    ]
    preflight(parse_args(base), 1)
    config = parse_args(
        base
        + [
            "--parallelism.expert_tensor_parallel_degree",
            "4",
            "--training.global_batch_size",
            "-1",
            "--parallelism.data_parallel_shard_degree",
            "4",
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"^moe.expert_kernels = 'fp8': the model width \(\d+\) and each expert's width "
        r"per etp rank \(\d+\) must be multiples of 16$",
    ):
        preflight(config, 4)
