"""Per-document attention of packed samples (training.document_masking) against the causal
attention of one stream, forward + backward at the trainer proxies' shapes.

    python bench/documents.py                 # GPU, bf16, 8K / 32K / 64K tokens per sample
    python bench/documents.py --smoke         # CPU, the debug flavors (for tests)

Each sample packs documents of lengths drawn log-uniformly between 64 tokens and the whole
sample (a few long, many short). "causal" is the models' call without documents (SDPA,
is_causal); "documents" is theirs with document_ids (models/documents.py: FlexAttention with a
block mask on CUDA, the block mask's build included in the time; an explicit mask elsewhere).
The masked output is checked against each document's causal attention alone (max error over
the reference's largest value), so a fast wrong kernel shows. Times are medians of CUDA-event
pairs; "ratio" is documents' time over causal's. On CUDA with one head width for q, k and v,
"varlen" is flash attention's varlen kernel (torch.nn.attention.varlen, where the build has it)
with each document as its own sequence, checked and timed the same way.
"""

import inspect
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention import PROXIES, SMOKE, attention_shape  # noqa: E402
from bench.common import median, script_parser, time_ms, write_result  # noqa: E402
from titan_fold.models.documents import document_mask, masked_attention  # noqa: E402

try:  # flash attention's varlen kernel over the documents as separate sequences (torch >= 2.10)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None
VARLEN_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


def document_ids(seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[seq_len] int64: documents of log-uniform lengths in [64, seq_len], the last cut to fit."""
    lengths, total = [], 0
    low, high = torch.log(torch.tensor(64.0)), torch.log(torch.tensor(float(seq_len)))
    while total < seq_len:
        n = int(torch.exp(low + (high - low) * torch.rand((), generator=generator)))
        lengths.append(min(n, seq_len - total))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def main(argv=None) -> dict:
    p = script_parser(__doc__, "documents", 3, 20, "CPU, the debug flavors in float32, 128 tokens (for tests)")
    p.add_argument("--seq-lens", default="8192,32768,65536")
    a = p.parse_args(argv)
    proxies, dtype, seq_lens = PROXIES, torch.bfloat16, [int(s) for s in a.seq_lens.split(",")]
    if a.smoke:
        a.device, a.warmup, a.iters, proxies, dtype, seq_lens = "cpu", 1, 2, SMOKE, torch.float32, [128]
    device = torch.device(a.device)
    rows = []
    for family, proxy, _ in proxies:
        shape = attention_shape(family, proxy)
        h, hk, dqk, dv = shape["heads"], shape["kv_heads"], shape["qk_dim"], shape["v_dim"]
        for s in seq_lens:
            gen = torch.Generator().manual_seed(0)
            ids = document_ids(s, gen).to(device)[None]  # [1, s]
            q, k, v, grad = (
                torch.randn(1, n, s, d, generator=gen).to(device, dtype)
                for n, d in ((h, dqk), (hk, dqk), (hk, dv), (h, dv))
            )

            starts = torch.nonzero(torch.diff(ids[0], prepend=ids[0, :1] - 1)).flatten().tolist() + [s]
            cu_seq = torch.tensor(starts, dtype=torch.int32, device=device)
            longest = max(hi - lo for lo, hi in itertools.pairwise(starts))

            def call(way: str, qkv=(q, k, v), ids=ids, grad=grad, gqa=h != hk, cu_seq=cu_seq, longest=longest):
                x = [t.detach().requires_grad_() for t in qkv]
                if way == "documents":
                    out = masked_attention(*x, document_mask(ids))
                elif way == "varlen":  # [1, heads, s, d] <-> [s, heads, d]
                    x3 = [t[0].transpose(0, 1) for t in x]
                    if gqa and not VARLEN_GQA:  # the K/V heads repeated for their query groups
                        x3[1:] = [t.repeat_interleave(x3[0].shape[1] // t.shape[1], dim=1) for t in x3[1:]]
                    gqa_kw = {"enable_gqa": gqa} if VARLEN_GQA else {}
                    out = varlen_attn(*x3, cu_seq, cu_seq, longest, longest, window_size=(-1, 0), **gqa_kw)
                    out = out.transpose(0, 1)[None]
                else:
                    out = F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=gqa)
                out.backward(grad)
                return out.detach()

            # flash's varlen kernel takes one head width for q, k and v (not MLA's)
            ways = ["causal", "documents"] + ["varlen"] * (
                varlen_attn is not None and device.type == "cuda" and dqk == dv
            )
            row = {"family": family, "proxy": proxy, "seq_len": s, "documents": len(starts) - 1, **shape}
            for way in list(ways[1:]):
                try:
                    got = call(way).float()
                except (RuntimeError, TypeError) as e:  # varlen only: e.g. a build without its backward
                    if way != "varlen":
                        raise
                    row[f"{way}_failed"] = str(e)[:300]
                    ways.remove(way)
                    continue
                errors = []
                for lo, hi in itertools.pairwise(starts):
                    # K/V heads repeated by hand: SDPA's enable_gqa takes the math path, whose fp32
                    # score matrix of a 64K-token document does not fit
                    qd, kd, vd = (t[:, :, lo:hi].float() for t in (q, k, v))
                    kd, vd = (t.repeat_interleave(h // hk, dim=1) for t in (kd, vd))
                    ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                    errors.append(float((got[:, :, lo:hi] - ref).abs().max() / ref.abs().max()))
                key = "max_rel_err_vs_each_document" if way == "documents" else f"{way}_max_rel_err"
                row[key] = max(errors)
            for way in ways:
                row[f"{way}_ms"] = median(time_ms(lambda way=way: call(way), a.warmup, a.iters, device))
            row["ratio"] = row["documents_ms"] / row["causal_ms"]
            if "varlen_ms" in row:
                row["varlen_ratio"] = row["varlen_ms"] / row["causal_ms"]
            rows.append(row)
            print(
                f"[documents] {family} {proxy} s={s} ({row['documents']} documents): causal {row['causal_ms']:.3f} ms, "
                f"documents {row['documents_ms']:.3f} ms (x{row['ratio']:.2f}), "
                + (f"varlen {row['varlen_ms']:.3f} ms (x{row['varlen_ratio']:.2f}), " if "varlen_ms" in row else "")
                + f"max rel err {row['max_rel_err_vs_each_document']:.1e}",
                flush=True,
            )
    figures = {"dtype": str(dtype).removeprefix("torch."), "rows": rows}
    write_result(a.name, figures, a.out_dir)
    return figures


if __name__ == "__main__":
    main()
