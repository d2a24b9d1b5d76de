"""Qwen3.5-MoE's two token mixers side by side on one GPU: a Gated DeltaNet layer (linear attention)
against a gated full-attention layer, forward + backward, per token.

    python bench/gdn.py                       # Qwen3.5-35B-A3B widths, bf16, compiled: 4K (batch 2), 32K (batch 1)
    python bench/gdn.py --smoke               # CPU, the debug flavor (tests)

Each mixer is the module the model builds for its layer type (models/transformer.py: MIXERS), in
bf16, under torch.compile as the trainer compiles a block; the input [b, s, dim] random, the loss
the output's mean square. The Gated DeltaNet layer runs the rule models/gated_deltanet.py picks
(fla's kernels where models/gdn_fla.py can run them; the row says which). Figures per row: the
median milliseconds of a forward + backward, per million tokens, and linear over full.
"""

import dataclasses
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import median, script_parser, time_ms, write_result  # noqa: E402


def mixer_ms(mixer, args, b: int, s: int, device, compiled: bool, warmup: int, iters: int) -> float:
    cos, sin = (t[:s].to(device) for t in args.rope_tables())
    x = torch.randn(b, s, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    fn = torch.compile(mixer) if compiled else mixer

    def step():
        fn(x, cos, sin, mask=None).float().square().mean().backward()

    return median(time_ms(step, warmup, iters, device))


def main() -> None:
    p = script_parser(__doc__, "gdn", warmup=3, iters=10, smoke="the debug flavor on the CPU, eager")
    p.add_argument("--flavor", default="35B-A3B")
    p.add_argument("--shapes", default="2x4096,1x32768", help="batch x sequence, comma separated")
    a = p.parse_args()
    from titan_fold.models import FLAVORS, gdn_fla
    from titan_fold.models.transformer import MIXERS

    if a.smoke:
        a.flavor, a.shapes, a.warmup, a.iters = "debug", "2x64", 1, 2
    device = torch.device(a.device)
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in a.shapes.split(",")]
    args = FLAVORS["qwen3_5_moe"][a.flavor]
    args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, max(s for _, s in shapes)))
    full_id = args.layer_types.index("full_attention")
    mixers = {
        "full_attention": MIXERS["full_attention"](args, full_id),
        "linear_attention": MIXERS["linear_attention"](args, 0),
    }
    for mixer in mixers.values():
        mixer.to(device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            mixer.init_weights(0.02, 0.02)
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    probe = torch.empty(1, dk, device=device), torch.empty(1, dv, device=device)
    rule = gdn_fla.problem(*probe)
    rows = []
    for b, s in shapes:
        ms = {
            kind: mixer_ms(mixer, args, b, s, device, not a.smoke, a.warmup, a.iters) for kind, mixer in mixers.items()
        }
        rows.append(
            {
                "batch": b,
                "seq_len": s,
                "full_ms": ms["full_attention"],
                "linear_ms": ms["linear_attention"],
                "full_ms_per_mtok": ms["full_attention"] / (b * s) * 1e6,
                "linear_ms_per_mtok": ms["linear_attention"] / (b * s) * 1e6,
                "linear_over_full": ms["linear_attention"] / ms["full_attention"],
                "rule": "fla" if rule is None else f"torch chunked ({rule})",
                "compiled": not a.smoke,
            }
        )
        print(rows[-1])
    write_result(a.name, {"flavor": a.flavor, "rows": rows}, a.out_dir)


if __name__ == "__main__":
    main()
