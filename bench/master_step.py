"""The fp32 master-weight step alone, against what the GPU's memory delivers.

    python bench/master_step.py               # GPU, the trainer proxy's parameters
    python bench/master_step.py --smoke       # CPU, the debug model's parameters

`optimizer.master_weights` updates every parameter in one generated kernel
(titan_fold/optimizer._adam_master_step through fused()): it reads the bf16 gradient and
the fp32 master and Adam moments and writes the master, the moments and the bf16 weight,
28 bytes per parameter. Here it runs over tensors of the proxy's parameter shapes (Qwen2-
57B-A14B widths, 2 layers: 4.26e9 parameters, bench/train_step.py's default), timed with
CUDA events, beside two streaming kernels on 2^30 float32 elements (c = a + b: 12 bytes an
element; c.copy_(a): 8): the bandwidth a memory-bound kernel can reach on this GPU.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, time_ms, write_result  # noqa: E402
from bench.grad_norm import parameter_shapes  # noqa: E402
from titan_fold.common.fused import fused  # noqa: E402
from titan_fold.trainer.optimizer import _adam_master_step  # noqa: E402

BYTES_PER_PARAMETER = 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2  # read g, master, m, v; write master, m, v, weight


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen2_moe")
    p.add_argument("--proxy", default="57B-A14B-L2")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--stream-elements", type=int, default=1 << 30)
    p.add_argument("--smoke", action="store_true", help="CPU, the debug model (for tests)")
    p.add_argument("--name", default="master_step")
    p.add_argument("--out-dir", default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.proxy, a.warmup, a.iters, a.stream_elements = "cpu", "debug-L2", 1, 2, 1 << 16
    device = torch.device(a.device)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = []
    for shape in parameter_shapes(a.family, a.proxy):
        n = torch.Size(shape).numel()
        master = torch.randn(n, device=device, generator=gen) * 0.02
        tensors.append((master.bfloat16(), torch.randn(n, device=device, dtype=torch.bfloat16, generator=gen) * 1e-3,
                        master, torch.zeros(n, device=device), torch.zeros(n, device=device),
                        torch.zeros((), device=device)))
    numel = sum(t[0].numel() for t in tensors)
    scalars = torch.tensor([1e-4, 1.0], device=device)  # lr, 1 / grad_scale
    step = fused(_adam_master_step)

    def master_step():
        for weight, grad, master, exp_avg, exp_avg_sq, count in tensors:
            step(weight, grad, master, exp_avg, exp_avg_sq, count, scalars, 0.9, 0.95, 1e-8, 0.1, True)

    ms = median(time_ms(master_step, a.warmup, a.iters, device))
    rows = [{"kernel": "master_step", "ms": ms, "bytes": BYTES_PER_PARAMETER * numel,
             "tb_per_s": BYTES_PER_PARAMETER * numel / (ms * 1e-3) / 1e12}]
    tensors.clear()  # the GPU memory back for the streaming kernels
    x, y, z = (torch.rand(a.stream_elements, device=device, generator=gen) for _ in range(3))
    for kernel, fn, nbytes in (("add_fp32", lambda: torch.add(x, y, out=z), 12), ("copy_fp32", lambda: z.copy_(x), 8)):
        ms = median(time_ms(fn, a.warmup, a.iters, device))
        rows.append({"kernel": kernel, "ms": ms, "bytes": nbytes * a.stream_elements,
                     "tb_per_s": nbytes * a.stream_elements / (ms * 1e-3) / 1e12})
    for r in rows:
        print(f"[master_step] {r['kernel']}: {r['ms']:.3f} ms, {r['tb_per_s']:.2f} TB/s", flush=True)
    figures = {"family": a.family, "proxy": a.proxy, "parameters": numel, "rows": rows}
    write_result(a.name, figures, a.out_dir)
    return figures


if __name__ == "__main__":
    main()
