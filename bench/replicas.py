"""The planner of copies of hot experts (moe.hot_expert_replicas, moe/replicas.py) on one GPU: the
time of one layer call's plan, every pick mapped to a physical expert, at the Qwen3-30B-A3B
proxy's routing shape, eager and compiled, under a skewed and a uniform load.

    python bench/replicas.py                 # GPU: 8,192 tokens per rank, top 8 of 128, ep 2 and 8
    python bench/replicas.py --smoke         # CPU, small (for tests)

The plan reads the counts of every source of the ep group (here made up on this GPU, as if
gathered): the collectives of a real layer call (the counts' all-gather, the copies' weights)
are not in this time. Each row records the largest rank's rows without copies and as planned
(every source mapping its picks), so the plan's effect shows beside its cost. Times are medians of
CUDA-event pairs.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import median, script_parser, time_ms, write_result  # noqa: E402
from bench.forced_routing import weights  # noqa: E402
from titan_fold.moe.replicas import physical_experts  # noqa: E402


def main(argv=None) -> dict:
    p = script_parser(__doc__, "replicas", 5, 50, "CPU, 512 tokens, top 2 of 8 (for tests)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank and layer call")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--eps", default="2,8")
    p.add_argument("--copies", default="8,16")
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.warmup, a.iters, a.tokens, a.top_k, a.experts, a.eps, a.copies = "cpu", 1, 2, 512, 2, 8, "2", "2"
    device = torch.device(a.device)
    rows = []
    for ep in (int(e) for e in a.eps.split(",")):
        for load in ("skew", "uniform"):
            gen = torch.Generator().manual_seed(0)
            w = weights(load, a.experts)
            picks = [torch.multinomial(w.expand(a.tokens, -1), a.top_k, generator=gen) for _ in range(ep)]
            counts = torch.stack([torch.bincount(p.flatten(), minlength=a.experts) for p in picks]).to(device)
            idx = picks[0].to(device)  # [T, k] this source's picks (source 0)
            totals = counts.sum(0)
            for R in (int(r) for r in a.copies.split(",")):
                level = int(totals.view(ep, -1).sum(1).max())  # the largest rank's rows without copies
                planned = _largest_load(counts, ep, R, device)
                for mode in ("eager", "compiled"):
                    fn = physical_experts if mode == "eager" else torch.compile(physical_experts, dynamic=False)

                    def call(fn=fn, idx=idx, counts=counts, ep=ep, R=R):
                        return fn(idx, counts, 0, ep, R)

                    ms = median(time_ms(call, a.warmup, a.iters, device))
                    rows.append(
                        {
                            "ep": ep,
                            "load": load,
                            "copies": R,
                            "mode": mode,
                            "tokens": a.tokens,
                            "top_k": a.top_k,
                            "experts": a.experts,
                            "ms": ms,
                            "largest_rank_rows_without": level,
                            "largest_rank_rows_planned": planned,
                            "mean_rank_rows": int(totals.sum()) // ep,
                        }
                    )
                    print(rows[-1], flush=True)
                assert planned <= level, (planned, level)
    figures = {"rows": rows}
    write_result(a.name, figures, a.out_dir)
    return figures


def _largest_load(counts: torch.Tensor, ep: int, R: int, device) -> int:
    """The most rows one rank runs when every source maps its picks with the planner."""
    S, E = counts.shape
    per_rank = torch.zeros(ep, dtype=torch.int64, device=device)
    for me in range(S):
        idx = torch.repeat_interleave(torch.arange(E, device=device), counts[me])[:, None]
        physical, _ = physical_experts(idx, counts, me, ep, R)
        per_rank += torch.bincount(physical.flatten() // (E // ep + R), minlength=ep)
    return int(per_rank.max())


if __name__ == "__main__":
    main()
