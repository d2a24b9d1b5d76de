"""Host time per call of the eager path's generated kernels, against one plain torch op.

    python bench/launch.py              # GPU
    python bench/launch.py --smoke      # CPU (for tests: fused() runs its function as written there)

In eager mode the host launches a fine-grained MoE layer's kernels one by one, and at
Qwen3-30B-A3B shapes the forward is host-bound (docs/benchmarks.md): a call's host time is
then step time. Each call here runs on a few rows, so that the GPU finishes every kernel before
the host launches the next and the loop measures the host alone: microseconds per call over
--iters calls after --warmup, the median of --repeats such loops. The calls are those an eager
step makes per layer or per parameter: the SwiGLU times the routing weight and the sum over k
(common/fused.py's fused()), the q / k norms with RoPE, the router's choice with its losses and
statistics (moe/router.py's route_whole compiled with its backward, and on a GPU its Triton
kernels, moe/router_triton.py) and one parameter's Adam
step (trainer/optimizer.py). Where QuACK runs (moe.expert_kernels = "quack"), also one routed
varlen-M GEMM: torch._grouped_mm, QuACK's gemm (its general path: it replays only plain calls),
moe/quack.py's replay of the launch QuACK resolved, and the down projection's op through the
dispatcher against the direct call eager code makes.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import host_us, script_parser, write_result  # noqa: E402
from titan_fold.common.fused import fused  # noqa: E402
from titan_fold.models.layers import apply_rope_qk  # noqa: E402
from titan_fold.moe.args import MoEArgs  # noqa: E402
from titan_fold.moe.quack import _down_forward, _varlen_m, offsets, quack, quack_problem  # noqa: E402
from titan_fold.moe.router import _compiled_on, route_whole  # noqa: E402
from titan_fold.moe.router_triton import fused_route_whole  # noqa: E402
from titan_fold.moe.router_triton import supported as fused_supported  # noqa: E402
from titan_fold.moe.rows import _sum_by_token  # noqa: E402
from titan_fold.moe.swiglu import _pairs_prob_forward  # noqa: E402
from titan_fold.trainer.optimizer import AdamHyper, adam_update  # noqa: E402


def calls(device: torch.device) -> dict:
    """name -> a function making one call, on tensors of a few rows."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    rows, ffn, dim, k, experts, head_dim = 256, 768, 2048, 8, 128, 128
    ab, p = randn(rows, 2 * ffn), torch.rand(rows, 1, device=device, generator=gen)
    routed, slot = randn(rows * k, dim), torch.randperm(rows * k, device=device, generator=gen)
    q, kk = randn(1, rows, 4, head_dim), randn(1, rows, 1, head_dim)
    cos, sin = randn(rows, head_dim, dtype=torch.float32), randn(rows, head_dim, dtype=torch.float32)
    norms = [torch.nn.RMSNorm(head_dim, eps=1e-6, device=device, dtype=torch.bfloat16) for _ in range(2)]
    logits = randn(rows, experts, dtype=torch.float32).requires_grad_()
    bias = torch.zeros(experts, device=device)
    args = MoEArgs(num_experts=experts, top_k=k, load_balance="aux_free")
    route = _compiled_on(device, route_whole)
    n = 1 << 20
    weight, grad, exp_avg, exp_avg_sq = randn(n), randn(n), randn(n), randn(n).abs()
    coef = torch.tensor([1e-4, 1.0, 1.0, 1.0], device=device)
    found = {
        "torch.add (one plain op)": lambda: torch.add(ab, ab),
        "swiglu x routing weight (fused)": lambda: fused(_pairs_prob_forward)(ab, p),
        "sum over k (fused)": lambda: fused(_sum_by_token)(routed, slot, k, False),
        "q / k norms + RoPE (autograd Function, fused)": lambda: apply_rope_qk(q, kk, cos, sin, *norms),
        "router: choice and losses (compiled with backward)": lambda: route(logits, bias, rows, args, 1.0),
        "Adam step of one parameter (fused)": lambda: adam_update(
            weight, grad, None, exp_avg, exp_avg_sq, coef, AdamHyper(0.9, 0.95, 1e-8, 0.0, True)
        ),
    }
    if fused_supported(logits, rows):
        found["router: choice and losses (Triton kernels)"] = lambda: fused_route_whole(logits, bias, rows, args, 1.0)
    if device.type == "cuda" and quack_problem(device.index) is None:
        h, w2 = randn(rows * k, ffn), randn(experts, dim, ffn)  # rows * k routed rows, 16 per expert
        offs, gi = offsets(torch.full((experts,), rows * k // experts, device=device)), quack()
        found.update(
            {
                "varlen-M GEMM: torch._grouped_mm": lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offs[1:]),
                "varlen-M GEMM: QuACK's gemm": lambda: gi.gemm(h, w2.mT, cu_seqlens_m=offs, dynamic_scheduler=True),
                "varlen-M GEMM: QuACK's launch replayed (moe/quack.py)": lambda: _varlen_m(gi, h, w2.mT, offs),
                "down projection op, through the dispatcher": lambda: torch.ops.titan_fold.quack_down_forward(
                    h, offs, w2
                ),
                "down projection op, called directly (eager)": lambda: _down_forward(h, offs, w2),
            }
        )
    return found


def main(argv=None) -> dict:
    p = script_parser(__doc__, "launch", 30, 200, "CPU, few calls (for tests)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.warmup, a.iters, a.repeats = "cpu", 1, 2, 1
    device = torch.device(a.device)
    rows = []
    for name, fn in calls(device).items():
        us = host_us(fn, a.warmup, a.iters, a.repeats, device)
        rows.append({"call": name, "host_us": us})
        print(f"[launch] {name}: {us:.1f} us", flush=True)
    figures = {"device": a.device, "iters": a.iters, "repeats": a.repeats, "rows": rows}
    write_result(a.name, figures, a.out_dir)
    return figures


if __name__ == "__main__":
    main()
