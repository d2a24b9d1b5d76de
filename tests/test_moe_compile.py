"""torch.compile of the single-rank MoE layer (CPU)."""

import pytest
import torch

from titan_fold.moe import MoE, MoEArgs


def _layer_and_input(args, dtype):
    torch.manual_seed(0)
    moe = MoE(32, args)
    moe.init_weights(0.1)
    moe = moe.to(dtype)
    x = torch.randn(2, 16, 32, dtype=dtype)
    return moe, x


def _fwd_bwd(module, x):
    x = x.clone().requires_grad_()
    y = module(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return y.detach(), x.grad, grads


@pytest.mark.parametrize(
    "capacity_factor,token_drop,dtype",
    [(1.0, "drop_and_pad", torch.float32), (None, "dropless", torch.bfloat16)],
    ids=["drop_and_pad_fp32", "dropless_bf16"],
)
def test_fullgraph_compile(capacity_factor, token_drop, dtype):
    """Padded: every shape static. Dropless: sizes from device counts are unbacked
    symbols (fullgraph turns scalar capture on). No graph break, no recompile for new data."""
    args = MoEArgs(
        num_experts=8,
        top_k=2,
        moe_ffn_dim=32,
        shared_ffn_dim=16,
        shared_expert_gate=True,
        token_drop=token_drop,
        capacity_factor=capacity_factor,
        z_loss_coeff=1e-3,
    )
    moe, x = _layer_and_input(args, dtype)
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True)
    y_c, gx_c, g_c = _fwd_bwd(compiled, x)
    y_e, gx_e, g_e = _fwd_bwd(moe, x)
    tol = (
        dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    )  # bf16: fused kernels round less
    torch.testing.assert_close(y_c, y_e, **tol)
    torch.testing.assert_close(gx_c, gx_e, **tol)
    for a, b in zip(g_c, g_e, strict=True):
        torch.testing.assert_close(a, b, **tol)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _fwd_bwd(compiled, torch.randn_like(x) * 3)


def test_cudagraphs_marks_the_moe_buffers_static():
    """compile.cudagraphs: the buffers every MoE call updates in place are inputs at fixed
    addresses to torch.compile (a CUDA graph replays in-place updates only of such inputs);
    without the mark an FSDP2-wrapped block's forward is left out of the graphs."""
    from torch._dynamo.utils import get_static_address_type

    from titan_fold.parallel.parallelize import mark_static_buffers

    layers = [MoE(64, MoEArgs(num_experts=4, top_k=2, moe_ffn_dim=32, load_balance="aux_free")) for _ in range(2)]
    buffers = [b for layer in layers for b in layer.buffers()]
    assert buffers and all(get_static_address_type(b) is None for b in buffers)
    mark_static_buffers(layers)
    assert all(get_static_address_type(b) == "unguarded" for b in buffers)


@pytest.mark.parametrize("cudagraphs", [False, True])
def test_cudagraphs_step_starts_marked(monkeypatch, cudagraphs):
    """compile.cudagraphs: each training step tells CUDA graph trees that a step starts, before
    any of its work (left to guess, the trees start one at any torch.compile call outside their
    graphs, such as a fused() kernel in eager code between compiled blocks); without graphs
    nothing is marked."""
    from types import SimpleNamespace

    from titan_fold.trainer.fold_trainer import FoldTrainer

    calls = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append("mark"))
    trainer = SimpleNamespace(
        step=3,
        guard=SimpleNamespace(step=None),
        cudagraphs=cudagraphs,
        phases=None,
        _train_step=lambda data: calls.append(("step", data)),
    )
    FoldTrainer.train_step(trainer, "batches")
    FoldTrainer.train_step(trainer, "batches")
    step = [("step", "batches")]
    assert calls == (["mark", *step] * 2 if cudagraphs else step * 2) and trainer.guard.step == 3


def test_cudagraphs_freed_before_the_process_group(monkeypatch):
    """compile.cudagraphs: torch.compile's graphs are dropped before the process group goes (a graph
    holding NCCL kernels keeps its communicator, whose destruction then hangs); other runs keep
    their compiled code."""
    import torch.distributed as dist

    from titan_fold.common.config import parse_args
    from titan_fold.parallel.parallelize import release_cuda_graphs
    from titan_fold.trainer.fold_trainer import main

    resets = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append("reset"))
    release_cuda_graphs(parse_args(["--compile.enable"]))
    assert resets == []
    release_cuda_graphs(parse_args(["--compile.enable", "--compile.cudagraphs"]))
    assert resets == ["reset"]
    # the trainer's teardown: the graphs go, then the process group
    order = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: order.append("reset"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: order.append("destroy"))
    # a run that stops before training (experts over 2 ranks in a world of 1): the same order
    main(
        [
            "--job.config_file",
            "debug_moe.toml",
            "--compile.enable",
            "--compile.cudagraphs",
            "--moe.exchange",
            "static",
            "--parallelism.expert_parallel_degree",
            "2",
        ]
    )
    assert order == ["reset", "destroy"]
