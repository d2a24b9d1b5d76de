"""Moving token rows to expert order and back: the dispatcher's gathers against indexing.

    python bench/row_movement.py                 # GPU, bf16, the benchmark shapes
    python bench/row_movement.py --smoke         # CPU, tiny shape, float32

One MoE layer's row movement on one rank, forward + backward, without the experts:
dispatch (x [T, dim] -> rows [T*k, dim] in expert order), a stand-in elementwise op, and
combine (rows -> y [T, dim], the k rows of each token summed). Four ways, timed side by
side with CUDA events (median after warm-up):
  indexing       x[token_of_row] and index_add: their backwards are atomic scatter-adds
                 (the dispatcher before 2026-11-23)
  embedding_bag  the dispatcher's _Dispatch / _Combine (gathers both ways) with the sum over
                 k as one embedding_bag (gather and sum in one kernel, no [T*k, dim] copy)
  gather_sum     the same with the sum as rows[slot].view(T, k, dim).sum(1) (a [T*k, dim]
                 copy, then the sum)
  dispatcher     the dispatcher as it is
Outputs and input gradients are checked against indexing.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, script_parser, time_ms, write_result  # noqa: E402
from titan_fold.moe.dispatcher import group_by  # noqa: E402
from titan_fold.moe.rows import _Combine, _Dispatch, _inverse, _sum_by_token  # noqa: E402

SHAPES = {  # tokens per rank, hidden, top-k, experts
    "qwen2_57b_a14b": (8192, 3584, 8, 64),
    "mixtral_8x22b": (8192, 6144, 2, 8),
    "mixtral_8x22b_g8t8": (8192, 6144, 8, 64),
    "tiny": (256, 64, 2, 8),
}


# the alternatives to the dispatcher's sum over k, passed to its own _Dispatch / _Combine
def _embedding_bag(rows, slot, k, dropped):
    return F.embedding_bag(slot.view(-1, k), rows, mode="sum")


def _gather_sum(rows, slot, k, dropped):
    return rows[slot].view(-1, k, rows.shape[-1]).sum(1, dtype=rows.dtype)


def ways(token_of_row, slot, k):
    """way -> fwd_bwd(x, gy) = (y, dL/dx)."""
    T = token_of_row.numel() // k

    def indexing(x):
        rows = x[token_of_row] * 2
        return rows.new_zeros(T, x.shape[-1]).index_add(0, token_of_row, rows)

    def gathers(total=_sum_by_token):
        def run(x):
            rows = _Dispatch.apply(x, token_of_row, slot, k, False, total) * 2
            return _Combine.apply(rows, token_of_row, slot, k, False, total)

        return run

    def fwd_bwd(fn):
        def run(x, gy):
            y = fn(x)
            return y, torch.autograd.grad(y, x, gy)[0]

        return run

    return {
        "indexing": fwd_bwd(indexing),
        "embedding_bag": fwd_bwd(gathers(_embedding_bag)),
        "gather_sum": fwd_bwd(gathers(_gather_sum)),
        "dispatcher": fwd_bwd(gathers()),
    }


def bench_shape(name, device, dtype, warmup, iters) -> dict:
    T, dim, k, E = SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(0)
    key = torch.randint(0, E, (T * k,), device=device, generator=gen)
    order, _, _ = group_by(key, E)
    token_of_row, slot = order // k, _inverse(order)
    x = torch.randn(T, dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
    gy = torch.randn(T, dim, device=device, dtype=dtype, generator=gen)
    results, ref = {}, None
    for way, fwd_bwd in ways(token_of_row, slot, k).items():
        y, gx = fwd_bwd(x, gy)
        if ref is None:
            ref = (y.detach().float(), gx.float())
        else:  # same sums in another order: bf16 rounding apart
            torch.testing.assert_close(y.detach().float(), ref[0], atol=0.1, rtol=0.02)
            torch.testing.assert_close(gx.float(), ref[1], atol=0.1, rtol=0.02)
        results[f"{way}_ms"] = median(time_ms(lambda fwd_bwd=fwd_bwd: fwd_bwd(x, gy), warmup, iters, device))
    base = results["indexing_ms"]
    for way in ("embedding_bag", "gather_sum", "dispatcher"):
        results[f"{way}_speedup"] = base / results[f"{way}_ms"]
    rows_bytes = T * k * dim * x.element_size()
    return {
        "shape": name,
        "tokens": T,
        "dim": dim,
        "top_k": k,
        "experts": E,
        "row_bytes_mib": rows_bytes / 2**20,
        **results,
    }


def main(argv=None) -> dict:
    p = script_parser(__doc__, "row_movement", 5, 20, "CPU, tiny shape, float32", device=False)
    p.add_argument("--shapes", default="qwen2_57b_a14b,mixtral_8x22b,mixtral_8x22b_g8t8")
    a = p.parse_args(argv)
    if a.smoke:
        device, dtype, shapes = torch.device("cpu"), torch.float32, ["tiny"]
        a.warmup, a.iters = 1, 2
    else:
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, a.shapes.split(",")
    rows = []
    for name in shapes:
        rows.append(bench_shape(name, device, dtype, a.warmup, a.iters))
        print("[row_movement]", rows[-1], flush=True)
    print("wrote", write_result(a.name, {"rows": rows}, out_dir=a.out_dir))
    return {"rows": rows}


if __name__ == "__main__":
    main()
