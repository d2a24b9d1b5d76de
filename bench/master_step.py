"""The one-pass Adam steps alone (fp32 masters; bf16 parameters beside torch's fused AdamW),
against what the GPU's memory delivers.

    python bench/master_step.py               # GPU, the trainer proxy's parameters
    python bench/master_step.py --smoke       # CPU, the debug model's parameters

`optimizer.master_weights` updates every parameter in one generated kernel
(titan_fold/trainer/optimizer.py's adam_update: _adam_step through fused()): it reads the bf16
gradient and the fp32 master and Adam moments and writes the master, the moments and the bf16
weight, 28 bytes per parameter. Without masters (`optimizer.implementation = "fused"`) the same
step updates bf16 parameters and moments in place: 14 bytes per parameter, as torch's fused
AdamW (multi_tensor_apply) moves on the same parameters; after one step of each from the
same state (the clip's grad_scale 2) the weights and moments agree within one bf16 ulp, or
the script fails after writing its record. Here they run over tensors of the proxy's
parameter shapes (Qwen2-57B-A14B widths, 2 layers: 4.26e9 parameters, bench/train_step.py's
default), timed with CUDA events, beside two streaming kernels on 2^30 float32 elements
(c = a + b: 12 bytes an element; c.copy_(a): 8): the bandwidth a memory-bound kernel can
reach on this GPU.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, script_parser, time_ms, write_result  # noqa: E402
from bench.grad_norm import parameter_shapes  # noqa: E402
from titan_fold.trainer.optimizer import AdamHyper, adam_coefficients, adam_update  # noqa: E402

BYTES_PER_PARAMETER = 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2  # read g, master, m, v; write master, m, v, weight
BF16_BYTES_PER_PARAMETER = 2 * 7  # read weight, g, m, v; write weight, m, v


def main(argv=None) -> dict:
    p = script_parser(__doc__, "master_step", 2, 5, "CPU, the debug model (for tests)")
    p.add_argument("--family", default="qwen2_moe")
    p.add_argument("--proxy", default="57B-A14B-L2")
    p.add_argument("--stream-elements", type=int, default=1 << 30)
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.proxy, a.warmup, a.iters, a.stream_elements = "cpu", "debug-L2", 1, 2, 1 << 16
    device = torch.device(a.device)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = []
    for shape in parameter_shapes(a.family, a.proxy):
        n = torch.Size(shape).numel()
        master = torch.randn(n, device=device, generator=gen) * 0.02
        tensors.append(
            (
                master.bfloat16(),
                torch.randn(n, device=device, dtype=torch.bfloat16, generator=gen) * 1e-3,
                master,
                torch.zeros(n, device=device),
                torch.zeros(n, device=device),
                torch.zeros((), device=device),
            )
        )
    numel = sum(t[0].numel() for t in tensors)
    scalars = torch.tensor([1e-4, 1.0], device=device)  # lr, 1 / grad_scale

    def master_step():
        coefs = adam_coefficients([t[-1] for t in tensors], scalars, 0.9, 0.95, 0.1)
        for (weight, grad, master, exp_avg, exp_avg_sq, _), coef in zip(tensors, coefs, strict=True):
            adam_update(weight, grad, master, exp_avg, exp_avg_sq, coef, AdamHyper(0.9, 0.95, 1e-8, 0.1, True))

    rows = [_row("master_step", median(time_ms(master_step, a.warmup, a.iters, device)), BYTES_PER_PARAMETER * numel)]
    tensors.clear()  # the GPU memory back for the bf16 parameters
    bf16_rows, agreement = bf16_steps(parameter_shapes(a.family, a.proxy), device, gen, a.warmup, a.iters)
    rows += bf16_rows
    x, y, z = (torch.rand(a.stream_elements, device=device, generator=gen) for _ in range(3))
    for kernel, fn, nbytes in (("add_fp32", lambda: torch.add(x, y, out=z), 12), ("copy_fp32", lambda: z.copy_(x), 8)):
        rows.append(_row(kernel, median(time_ms(fn, a.warmup, a.iters, device)), nbytes * a.stream_elements))
    for r in rows:
        print(f"[master_step] {r['kernel']}: {r['ms']:.3f} ms, {r['tb_per_s']:.2f} TB/s", flush=True)
    print(
        f"[master_step] bf16 one-pass step against torch's fused AdamW after one step: at most "
        f"{agreement['max_ulps']:.0f} bf16 ulp apart, {agreement['fraction_off']:.2e} of the values differ",
        flush=True,
    )
    figures = {"family": a.family, "proxy": a.proxy, "parameters": numel, "rows": rows, "bf16_agreement": agreement}
    write_result(a.name, figures, a.out_dir)
    if agreement["max_ulps"] > 1:
        raise SystemExit("the one-pass bf16 step and torch's fused AdamW differ by more than one bf16 ulp")
    return figures


def _row(kernel: str, ms: float, nbytes: int) -> dict:
    return {"kernel": kernel, "ms": ms, "bytes": nbytes, "tb_per_s": nbytes / (ms * 1e-3) / 1e12}


def bf16_steps(shapes, device, gen, warmup: int, iters: int) -> tuple[list[dict], dict]:
    """The one-pass step (no masters) and torch's fused AdamW on bf16 parameters of `shapes`
    sharing their gradients: one step of each from the same state, compared (the largest
    distance in bf16 ulps and the fraction of values apart, over weights and both moments);
    then each timed on its own tensors. Given a grad_scale, torch's step also writes the
    divided gradient back (16 bytes per parameter); both rows count 14, so their TB/s
    compare as their times do."""
    lr, grad_scale, betas, eps, weight_decay = 1e-3, 2.0, (0.9, 0.95), 1e-8, 0.1
    ours, theirs = [], []
    for shape in shapes:
        n = torch.Size(shape).numel()
        weight = (torch.randn(n, device=device, generator=gen) * 0.02).bfloat16()
        grad = torch.randn(n, device=device, dtype=torch.bfloat16, generator=gen) * 1e-3
        ours.append((weight, grad, torch.zeros_like(weight), torch.zeros_like(weight), torch.zeros((), device=device)))
        theirs.append(weight.clone())
        theirs[-1].grad = grad
    numel = sum(t.numel() for t in theirs)
    scalars = torch.tensor([lr, 1 / grad_scale], device=device)

    def one_pass_step():
        coefs = adam_coefficients([t[-1] for t in ours], scalars, *betas, weight_decay)
        for (weight, grad, exp_avg, exp_avg_sq, _), coef in zip(ours, coefs, strict=True):
            adam_update(weight, grad, None, exp_avg, exp_avg_sq, coef, AdamHyper(*betas, eps, weight_decay, True))

    torch_adamw = torch.optim.AdamW(theirs, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
    torch_adamw.grad_scale = torch.tensor(grad_scale, device=device)  # as parallel/clip.py sets it
    one_pass_step()
    torch_adamw.step()
    max_ulps, off, total = 0.0, 0, 0
    for (weight, _, exp_avg, exp_avg_sq, _), p in zip(ours, theirs, strict=True):
        state = torch_adamw.state[p]
        # a weight's ulp at |weight| + lr: a weight the step brings near 0 is the difference of two
        # terms of about lr, whose fp32 roundings (op order, x / 2 against x * 0.5) show there
        for x, ref, size in ((weight, p, lr), (exp_avg, state["exp_avg"], 0.0), (exp_avg_sq, state["exp_avg_sq"], 0.0)):
            for xs, rs in zip(x.split(1 << 26), ref.split(1 << 26), strict=True):  # float32 copies of a chunk at a time
                rs = rs.float()
                ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(
                    torch.floor(torch.log2((rs.abs() + size).clamp(min=torch.finfo(torch.bfloat16).tiny)))
                )
                d = (xs.float() - rs).abs() / ulp
                max_ulps, off, total = max(max_ulps, d.max().item()), off + (d > 0).sum().item(), total + d.numel()
    agreement = {"max_ulps": max_ulps, "fraction_off": off / total, "lr": lr, "grad_scale": grad_scale}
    nbytes = BF16_BYTES_PER_PARAMETER * numel
    rows = [
        _row("adam_step_bf16", median(time_ms(one_pass_step, warmup, iters, device)), nbytes),
        _row("torch_fused_adamw_bf16", median(time_ms(torch_adamw.step, warmup, iters, device)), nbytes),
    ]
    return rows, agreement


if __name__ == "__main__":
    main()
