"""The router's choice and the dispatcher's grouping, alone: the sorts a fine-grained layer runs.

    python bench/routing.py                      # GPU, the benchmark shapes
    python bench/routing.py --smoke              # CPU, tiny shape, eager only

Per shape (tokens per rank, experts, top-k), eager, compiled with static widths and compiled with
the token count dynamic (how moe/router.py compiles route in eager mode: any number of tokens, the
expert count static), each call captured in a CUDA graph and its replays timed side by side with
CUDA events (median after warm-up):
  choice     the k best experts of each token's scores [T, E] float32: aten's topk, the head of a
             stable descending sort, and k argmax passes each masking its pick (route's
             top_k_indices); the same columns chosen are checked. At DeepSeek-V3's shape also
             the group-limited choice (its 8 groups, the best 4 kept: limit_to_groups, then the k
             best) with aten's topk and with the argmax passes choosing the groups kept and the k
             (each group's best two as limit_to_groups chooses them)
  grouping   the T * k assignments' expert ids sorted stably (dispatcher.group_by's sort) as
             int64, int32, int16 and uint8 keys (a radix sort takes a pass per key byte; the
             same order is checked), and group_by itself
And once per shape, the router's whole per-token work with the shape's model's routing (ROUTERS,
aux-free balancing) both ways eager mode runs it: route_whole compiled (on CUDA with the token
count dynamic, moe/router.py's _compiled_on; on the CPU as written) and, on CUDA, its Triton
kernels (moe/router_triton.py): the kernels each way's forward and backward launch, a forward +
backward's time (uncaptured, as eager mode runs it, its host time included); the same experts
chosen is checked.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import graph_of, median, script_parser, time_ms, write_result  # noqa: E402
from titan_fold.moe.args import MoEArgs  # noqa: E402
from titan_fold.moe.dispatcher import group_by  # noqa: E402
from titan_fold.moe.router import _compiled_on, limit_to_groups, route_whole, top_k_indices  # noqa: E402
from titan_fold.moe.router_triton import fused_route_whole  # noqa: E402
from titan_fold.moe.router_triton import supported as fused_supported  # noqa: E402

SHAPES = {  # tokens per rank, experts, top-k
    "qwen2_57b_a14b": (8192, 64, 8),
    "qwen3_30b_a3b": (8192, 128, 8),
    "deepseek_v3": (8192, 256, 8),
    "tiny": (256, 8, 2),
}
KEYS = (torch.int64, torch.int32, torch.int16, torch.uint8)
GROUPS = {"deepseek_v3": (8, 4), "tiny": (4, 2)}  # groups, groups kept
ROUTERS = {  # route's settings of each shape's model, beside MoEArgs' defaults (softmax scores)
    "qwen2_57b_a14b": {},
    "qwen3_30b_a3b": {"norm_topk_prob": True},
    "deepseek_v3": {
        "score_func": "sigmoid",
        "norm_topk_prob": True,
        "num_groups": 8,
        "group_topk": 4,
        "routed_scaling_factor": 2.5,
    },
    "tiny": {"score_func": "sigmoid", "num_groups": 4, "group_topk": 2},
}


def _topk(scores, k):
    return scores.topk(k, dim=-1).indices


def _sort_head(scores, k):
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


CHOICES = {"topk": _topk, "sort_head": _sort_head, "argmax": top_k_indices}
GROUPED_CHOICES = ("topk", "argmax")
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
    if name in GROUPS:
        groups, kept = GROUPS[name]
        # sums of two scores can tie where the scores are multiples of 1 / E: drawn in [0, 1) instead
        drawn = torch.rand(T, E, device=device, generator=gen)
        if compiled == "dynamic tokens":
            torch._dynamo.maybe_mark_dynamic(drawn, 0)
        want = None
        for choice in GROUPED_CHOICES:
            pick = CHOICES[choice]
            fn = wrap(lambda s, pick=pick: pick(limit_to_groups(s, groups, kept, pick), k))
            got = fn(drawn)
            want = got if want is None else want
            assert torch.equal(got, want), f"the group-limited {choice} chose other experts than topk"
            row[f"grouped_choice_{choice}_us"] = _timed_us(lambda fn=fn: fn(drawn), device, warmup, iters)
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
        row[f"grouping_sort_{str(dtype).removeprefix('torch.')}_us"] = _timed_us(
            lambda sort=sort, narrow=narrow: sort(narrow), device, warmup, iters
        )
    grouped = wrap(lambda t: group_by(t, E + 1))
    row["group_by_us"] = _timed_us(lambda: grouped(key), device, warmup, iters)
    return row


def bench_route(name, device, warmup, iters) -> dict:
    T, E, k = SHAPES[name]
    args = MoEArgs(num_experts=E, top_k=k, load_balance="aux_free", **ROUTERS[name])
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(T, E, device=device, generator=gen, requires_grad=True)
    bias, upstream = torch.zeros(E, device=device), torch.randn(T, k, device=device, generator=gen)
    ways = {"compiled": _compiled_on(device, route_whole)}
    if fused_supported(logits, T // 2):
        ways["triton"] = fused_route_whole
    row, chosen = {"shape": name, "tokens": T, "experts": E, "top_k": k, "route": ROUTERS[name]}, {}
    for way, fn in ways.items():
        torch._dynamo.reset()

        def forward(fn=fn):
            return fn(logits, bias, T // 2, args, 1.0)[:2]  # probs [T, k], experts: two sequences

        for _ in range(3):  # compiled and warm
            forward()[0].backward(upstream)
        chosen[way] = forward()[1]
        if device.type == "cuda":
            (probs, _), row[f"route_{way}_forward_kernels"] = _kernels(forward, device)
            _, row[f"route_{way}_backward_kernels"] = _kernels(lambda probs=probs: probs.backward(upstream), device)
        # not captured: in eager mode the router runs so, its host time included
        row[f"route_{way}_us"] = 1e3 * median(time_ms(lambda: forward()[0].backward(upstream), warmup, iters, device))
    assert all(torch.equal(c, chosen["compiled"]) for c in chosen.values()), "the router's ways chose other experts"
    return row


def _kernels(fn, device) -> tuple:
    """(fn(), the names of the CUDA kernels it launched, in order)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize(device)
    return out, [evt.name[:120] for evt in prof.events() if evt.device_type == DeviceType.CUDA]


def main(argv=None) -> dict:
    p = script_parser(__doc__, "routing", 10, 100, "CPU, tiny shape, eager only", device=False)
    p.add_argument("--shapes", default="qwen2_57b_a14b,qwen3_30b_a3b,deepseek_v3")
    a = p.parse_args(argv)
    if a.smoke:
        device, shapes, modes = torch.device("cpu"), ["tiny"], [False]
        a.warmup, a.iters = 1, 2
    else:
        device, shapes, modes = torch.device("cuda"), a.shapes.split(","), MODES
    rows, routes = [], []
    for name in shapes:
        for compiled in modes:
            rows.append(bench_shape(name, device, compiled, a.warmup, a.iters))
            print("[routing]", rows[-1], flush=True)
        routes.append(bench_route(name, device, a.warmup, a.iters))
        print("[routing]", routes[-1], flush=True)
    print("wrote", write_result(a.name, {"rows": rows, "routes": routes}, out_dir=a.out_dir))
    return {"rows": rows, "routes": routes}


if __name__ == "__main__":
    main()
