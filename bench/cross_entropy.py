"""The training loss, forward + backward: torchtitan's cross_entropy_loss and titan_fold's token_cross_entropy.

    python bench/cross_entropy.py             # GPU, the Qwen3 proxies' logits: 2 x 4096 tokens, vocab 151,936, bf16
    python bench/cross_entropy.py --smoke     # CPU, small logits

Both in eager mode, as the trainer runs them without torch.compile of the loss:
  torchtitan  the logits cast to float32, F.cross_entropy (sum over the labels not ignored)
  titan_fold  common/cross_entropy.py: on CUDA one generated kernel each way (the CPU runs torchtitan's)
Timed side by side with CUDA events (median after warm-up): ms, the effective bandwidth of the
least traffic a loss can make (the logits read twice, their gradient written once), the peak memory
the loss adds over the logits, and titan_fold's loss and gradient against torchtitan's.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, time_ms, write_result  # noqa: E402
from titan_fold.common.cross_entropy import IGNORE_INDEX, token_cross_entropy  # noqa: E402


def main(argv=None) -> dict:
    from torchtitan.components.loss import cross_entropy_loss

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU, small logits (for tests)")
    p.add_argument("--name", default="cross_entropy")
    p.add_argument("--out-dir", default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.batch, a.seq_len, a.vocab, a.warmup, a.iters = "cpu", 2, 64, 1000, 1, 2
    device = torch.device(a.device)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(a.batch, a.seq_len, a.vocab, device=device, generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, a.vocab, (a.batch, a.seq_len), device=device, generator=gen)
    labels[:, -1] = IGNORE_INDEX  # past the end of each sequence
    ways = {"torchtitan": cross_entropy_loss, "titan_fold": token_cross_entropy}
    results = {}

    def step(fn):
        logits.grad = None
        fn(logits, labels).backward()

    for way, fn in ways.items():
        step(fn)
        results[way] = (fn(logits, labels).detach(), logits.grad.clone())
        logits.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ms = median(time_ms(lambda: step(fn), a.warmup, a.iters, device))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
        results[way] += (ms, peak)
    ref_loss, ref_grad = results["torchtitan"][:2]
    rows = []
    for way, (loss, grad, ms, peak) in results.items():
        off = (grad.float() - ref_grad.float()).abs()
        rows.append({"way": way, "ms": ms, "tb_per_s": 3 * logits.numel() * 2 / (ms * 1e-3) / 1e12, "peak_gib": peak,
                     "loss": float(loss), "loss_rel_diff": abs(float(loss) / float(ref_loss) - 1),
                     "grad_max_abs_diff": float(off.max()), "grad_share_differing": float((off > 0).float().mean())})
        print(f"[cross_entropy] {way}: {ms:.3f} ms, {rows[-1]['tb_per_s']:.2f} TB/s, peak {peak} GiB, "
              f"loss {float(loss):.6g} (rel diff {rows[-1]['loss_rel_diff']:.1e}), grad max diff "
              f"{rows[-1]['grad_max_abs_diff']:.1e}", flush=True)
    figures = {"tokens": a.batch * a.seq_len, "vocab": a.vocab, "dtype": "bfloat16", "rows": rows}
    write_result(a.name, figures, a.out_dir)
    return figures


if __name__ == "__main__":
    main()
