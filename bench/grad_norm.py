"""The gradient norm of the clip: torch's foreach norm against one norm per tensor.

    python bench/grad_norm.py                 # GPU, the trainer proxy's gradients (bf16)
    python bench/grad_norm.py --smoke         # CPU, the debug model's gradients

Gradients of random values with the shapes of a model's parameters (the proxy Qwen2-57B-A14B,
2 layers, 4.26e9 parameters: bench/train_step.py's default), in bf16 as the trainer with
bf16 weights has them. Two ways to the total 2-norm, timed side by side with CUDA events
(median after warm-up):
  foreach     torch.nn.utils.get_total_norm(grads, foreach=True): torch's multi-tensor
              norm, what the trainer's clip ran before 2026-11-24 (4.1 ms of a 216 ms step
              in the profiled proxy, about 2.1 TB/s)
  per_tensor  one torch.linalg.vector_norm per gradient, accumulated in float32
              (parallel/clip.py since 2026-11-24)
Both against a float64 norm of the same gradients (relative error), and the effective
bandwidth (the gradients' bytes over the time).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, time_ms, write_result  # noqa: E402
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen2_moe")
    p.add_argument("--proxy", default="57B-A14B-L2")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU, the debug model (for tests)")
    p.add_argument("--name", default="grad_norm")
    p.add_argument("--out-dir", default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.proxy, a.warmup, a.iters = "cpu", "debug-L2", 1, 2
    device = torch.device(a.device)
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16, generator=gen) * 1e-3
             for s in parameter_shapes(a.family, a.proxy)]
    numel = sum(g.numel() for g in grads)
    ref = sum(float(g.double().square().sum()) for g in grads) ** 0.5
    ways = {
        "foreach": lambda: torch.nn.utils.get_total_norm(grads, 2.0, False, True),
        "per_tensor": lambda: total_norm(grads, 2.0),
    }
    rows = []
    for way, fn in ways.items():
        got = float(fn())
        ms = median(time_ms(fn, a.warmup, a.iters, device))
        rows.append({"way": way, "ms": ms, "tb_per_s": 2 * numel / (ms * 1e-3) / 1e12,
                     "norm": got, "rel_err_vs_float64": abs(got - ref) / ref})
        print(f"[grad_norm] {way}: {ms:.3f} ms, {rows[-1]['tb_per_s']:.2f} TB/s, rel err {rows[-1]['rel_err_vs_float64']:.2e}",
              flush=True)
    figures = {"family": a.family, "proxy": a.proxy, "parameters": numel, "tensors": len(grads),
               "dtype": "bfloat16", "norm_float64": ref, "rows": rows}
    write_result(a.name, figures, a.out_dir)
    return figures


if __name__ == "__main__":
    main()
