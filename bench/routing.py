"""The router's choice and the dispatcher's grouping, alone: the sorts a fine-grained layer runs.

    python bench/routing.py                      # GPU, the benchmark shapes
    python bench/routing.py --smoke              # CPU, tiny shape, eager only

Per shape (tokens per rank, experts, top-k), eager, compiled with static widths and compiled with
the token count dynamic (how moe/router.py compiles route in eager mode: any number of tokens, the
expert count static), each call captured in a CUDA graph and its replays timed side by side with
CUDA events (median after warm-up):
  choice     the k best experts of each token's scores [T, E] float32: aten's topk, the head of a
             stable descending sort, and k argmax passes each masking its pick (route's
             top_k_indices); the same columns chosen are checked
  grouping   the T * k assignments' expert ids sorted stably (dispatcher.group_by's sort) as
             int64, int32, int16 and uint8 keys (a radix sort takes a pass per key byte; the
             same order is checked), and group_by itself
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import graph_of, median, script_parser, time_ms, write_result  # noqa: E402
from titan_fold.moe.dispatcher import group_by  # noqa: E402
from titan_fold.moe.router import top_k_indices  # noqa: E402

SHAPES = {  # tokens per rank, experts, top-k
    "qwen2_57b_a14b": (8192, 64, 8),
    "qwen3_30b_a3b": (8192, 128, 8),
    "deepseek_v3": (8192, 256, 8),
    "tiny": (256, 8, 2),
}
KEYS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _topk(scores, k):
    return scores.topk(k, dim=-1).indices


def _sort_head(scores, k):
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


CHOICES = {"topk": _topk, "sort_head": _sort_head, "argmax": top_k_indices}
MODES = (False, True, "dynamic tokens")  # eager, compiled with static widths, the token count dynamic


def _timed_us(fn, device, warmup, iters) -> float:
    """Median us of fn; on CUDA each call captured once in a CUDA graph and its replays timed, so a
    compiled function's host work (guards) does not hide kernels of tens of microseconds."""
    if device.type == "cuda":
        fn = graph_of(fn, device)
    return 1e3 * median(time_ms(fn, warmup, iters, device))


def bench_shape(name, device, compiled, warmup, iters) -> dict:
    T, E, k = SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(0)
    # each row a permutation of E distinct scores in [0, 1): one right choice of k
    scores = torch.rand(T, E, device=device, generator=gen).argsort(dim=-1).float() / E
    row = {"shape": name, "tokens": T, "experts": E, "top_k": k, "compiled": compiled}
    # each shape compiles for its own widths, as a trainer (one model) does: kept from an earlier
    # shape the functions would be recompiled with dynamic widths
    torch._dynamo.reset()
    if compiled == "dynamic tokens":
        torch._dynamo.maybe_mark_dynamic(scores, 0)
    wrap = torch.compile if compiled else (lambda fn: fn)
    want = _topk(scores, k)
    for choice, fn in CHOICES.items():
        fn = wrap(fn)
        assert torch.equal(fn(scores, k), want), f"{choice} chose other experts than topk"
        row[f"choice_{choice}_us"] = _timed_us(lambda fn=fn: fn(scores, k), device, warmup, iters)
    if compiled == "dynamic tokens":  # the grouping is compiled with the layer, static widths
        return row
    key = _sort_head(scores, k).flatten()  # [T * k] expert ids
    order = torch.sort(key, stable=True).indices
    for dtype in KEYS:
        if E > torch.iinfo(dtype).max:
            continue
        narrow = key.to(dtype)
        sort = wrap(lambda t: torch.sort(t, stable=True).indices)
        assert torch.equal(sort(narrow), order), f"the sort of {dtype} keys gave another order"
        row[f"grouping_sort_{str(dtype).removeprefix('torch.')}_us"] = _timed_us(lambda: sort(narrow), device,
                                                                                 warmup, iters)
    grouped = wrap(lambda t: group_by(t, E + 1))
    row["group_by_us"] = _timed_us(lambda: grouped(key), device, warmup, iters)
    return row


def main(argv=None) -> dict:
    p = script_parser(__doc__, "routing", 10, 100, "CPU, tiny shape, eager only", device=False)
    p.add_argument("--shapes", default="qwen2_57b_a14b,qwen3_30b_a3b,deepseek_v3")
    a = p.parse_args(argv)
    if a.smoke:
        device, shapes, modes = torch.device("cpu"), ["tiny"], [False]
        a.warmup, a.iters = 1, 2
    else:
        device, shapes, modes = torch.device("cuda"), a.shapes.split(","), MODES
    rows = []
    for name in shapes:
        for compiled in modes:
            rows.append(bench_shape(name, device, compiled, a.warmup, a.iters))
            print("[routing]", rows[-1], flush=True)
    print("wrote", write_result(a.name, {"rows": rows}, out_dir=a.out_dir))
    return {"rows": rows}


if __name__ == "__main__":
    main()
