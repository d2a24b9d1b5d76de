"""Causal attention forward + backward at the trainer proxies' shapes, per SDPA backend.

    python bench/attention.py                 # GPU, bf16
    python bench/attention.py --smoke         # CPU, the debug flavors (for tests)

For each proxy of the trainer suites (Qwen3-MoE at Qwen3-30B-A3B and Qwen2-57B-A14B widths:
grouped-query attention; DeepSeek-V3 16B: MLA, a value head_dim other than the query's), q, k, v
laid out as the models pass them ([b, s, heads, head_dim] transposed to [b, heads, s, head_dim])
go through F.scaled_dot_product_attention forward and backward, once with each backend alone
(where it takes the inputs) and once as the models call it: torch's own choice ("default"; on
Hopper with torch 2.11, cuDNN's kernel at every proxy's shape).
Times are medians of CUDA-event pairs; TFLOP/s count the trainer's attention FLOPs (3x the causal
forward, models/args.py). Each output and gradient is checked against the same call in the math
backend at float32 (max error over the reference's largest value), so a fast wrong kernel shows.
"""

import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, script_parser, time_ms, write_result  # noqa: E402
from bench.train_step import register_proxy  # noqa: E402

PROXIES = (("qwen3_moe", "30B-A3B-L12", 2), ("qwen3_moe", "57B-A14B-L2", 2), ("deepseek_v3", "16B-L4", 2))
SMOKE = (("qwen3_moe", "debug-L2", 2), ("deepseek_v3", "debug-L2", 2))
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def attention_shape(family: str, proxy: str) -> dict:
    from titan_fold.models import FLAVORS

    register_proxy(family, proxy)
    args = FLAVORS[family][proxy]
    mla = hasattr(args, "v_head_dim")  # MLA: every head has its own key and value
    return {
        "heads": args.n_heads,
        "kv_heads": args.n_heads if mla else args.n_kv_heads,
        "qk_dim": args.head_dim,
        "v_dim": args.v_head_dim if mla else args.head_dim,
        "flops_dim": args.attention_flops_dim(),
    }


def main(argv=None) -> dict:
    p = script_parser(__doc__, "attention", 3, 20, "CPU, the debug flavors in float32 (for tests)")
    p.add_argument("--seq-len", type=int, default=4096)
    a = p.parse_args(argv)
    proxies, dtype = PROXIES, torch.bfloat16
    if a.smoke:
        a.device, a.seq_len, a.warmup, a.iters, proxies, dtype = "cpu", 64, 1, 2, SMOKE, torch.float32
    device = torch.device(a.device)
    rows = []
    for family, proxy, batch in proxies:
        shape = attention_shape(family, proxy)
        h, hk, dqk, dv, s = shape["heads"], shape["kv_heads"], shape["qk_dim"], shape["v_dim"], a.seq_len
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, grad = (
            torch.randn(batch, s, n, d, device=device, dtype=dtype, generator=gen).transpose(1, 2)
            for n, d in ((h, dqk), (hk, dqk), (hk, dv), (h, dv))
        )
        gqa = h != hk

        def call(backends, q=q, k=k, v=v, grad=grad, gqa=gqa):  # this shape's inputs
            x = [t.detach().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=gqa)
            out.backward(grad)
            return [out.detach(), *(t.grad for t in x)]

        xs = [t.detach().float().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=gqa)
        out.backward(grad.float())
        ref = [out.detach(), *(t.grad for t in xs)]
        flops = 6 * batch * s * s * h * shape["flops_dim"]  # the trainer's MFU count for these tokens
        ways = {**{n: [b] for n, b in BACKENDS.items()}, "default": None}
        for way, backends in ways.items():
            row = {"family": family, "proxy": proxy, "batch": batch, "seq_len": s, **shape, "way": way}
            try:
                got = call(backends)
            except RuntimeError as e:  # this backend does not take these inputs
                rows.append({**row, "error": str(e).splitlines()[0][:120]})
                print(f"[attention] {family} {proxy} {way}: {rows[-1]['error']}", flush=True)
                continue
            row["max_rel_err_vs_fp32_math"] = max(
                float((g.float() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref, strict=True)
            )
            row["ms"] = median(time_ms(lambda backends=backends: call(backends), a.warmup, a.iters, device))
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            rows.append(row)
            print(
                f"[attention] {family} {proxy} {way}: {row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s, "
                f"max rel err {row['max_rel_err_vs_fp32_math']:.1e}",
                flush=True,
            )
    figures = {"dtype": str(dtype).removeprefix("torch."), "rows": rows}
    write_result(a.name, figures, a.out_dir)
    return figures


if __name__ == "__main__":
    main()
