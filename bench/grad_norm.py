"""The gradient norm of the clip: torch's foreach norm, one norm per tensor, and titan_fold's.

    python bench/grad_norm.py                 # GPU, the Qwen3-30B-A3B proxy's gradients (bf16)
    python bench/grad_norm.py --smoke         # CPU, the debug model's gradients

Gradients of random values with the shapes of a model's parameters (the trainer suite's
Qwen3-30B-A3B proxy, 12 layers, 7.6e9 parameters), in bf16 as the trainer with bf16 weights
has them. Three ways to the total 2-norm, timed side by side with CUDA events (median after
warm-up):
  foreach     torch.nn.utils.get_total_norm(grads, foreach=True): torch's multi-tensor norm
  per_tensor  one torch.linalg.vector_norm per gradient, accumulated in float32
  titan_fold  parallel/clip.py's total_norm: per_tensor, but the large CUDA gradients'
              squares summed by a Triton kernel (parallel/sum_squares.py); equals per_tensor
              off CUDA
Each against a float64 norm of the same gradients (relative error), with the effective
bandwidth (the gradients' bytes over the time) and the host's time to queue one call
(median wall time of calls made without waiting for the device).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import host_us, median, script_parser, time_ms, write_result  # noqa: E402
from bench.train_step import register_proxy  # noqa: E402
from titan_fold.parallel.clip import total_norm  # noqa: E402


def parameter_shapes(family: str, proxy: str) -> list[torch.Size]:
    from titan_fold.models import FLAVORS
    from titan_fold.models.transformer import Transformer

    register_proxy(family, proxy)
    with torch.device("meta"):
        model = Transformer(FLAVORS[family][proxy])
    return [p.shape for p in model.parameters()]


def main(argv=None) -> dict:
    p = script_parser(__doc__, "grad_norm", 3, 10, "CPU, the debug model (for tests)")
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--proxy", default="30B-A3B-L12")
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.proxy, a.warmup, a.iters = "cpu", "debug-L2", 1, 2
    device = torch.device(a.device)
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [
        torch.randn(s, device=device, dtype=torch.bfloat16, generator=gen) * 1e-3
        for s in parameter_shapes(a.family, a.proxy)
    ]
    numel = sum(g.numel() for g in grads)
    ref = sum(float(g.double().square().sum()) for g in grads) ** 0.5
    ways = {
        "foreach": lambda: torch.nn.utils.get_total_norm(grads, 2.0, False, True),
        "per_tensor": lambda: torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads])
        ),
        "titan_fold": lambda: total_norm(grads, 2.0),
    }
    rows = []
    for way, fn in ways.items():
        got = float(fn())
        ms = median(time_ms(fn, a.warmup, a.iters, device))
        rows.append(
            {
                "way": way,
                "ms": ms,
                "tb_per_s": 2 * numel / (ms * 1e-3) / 1e12,
                "host_ms": host_us(fn, 0, 1, a.iters, device) / 1e3,
                "norm": got,
                "rel_err_vs_float64": abs(got - ref) / ref,
            }
        )
        print(
            f"[grad_norm] {way}: {ms:.3f} ms, {rows[-1]['tb_per_s']:.2f} TB/s, host {rows[-1]['host_ms']:.3f} ms, "
            f"rel err {rows[-1]['rel_err_vs_float64']:.2e}",
            flush=True,
        )
    figures = {
        "family": a.family,
        "proxy": a.proxy,
        "parameters": numel,
        "tensors": len(grads),
        "dtype": "bfloat16",
        "norm_float64": ref,
        "rows": rows,
    }
    write_result(a.name, figures, a.out_dir)
    return figures


if __name__ == "__main__":
    main()
