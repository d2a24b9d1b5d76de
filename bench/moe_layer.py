"""Forward + backward TFLOP/s of one titan_fold MoE layer at real shapes, with a breakdown.

    python bench/moe_layer.py                                   # 1 GPU: 4 shapes x (dropless, cf 1.0) x (eager, compiled)
    python bench/moe_layer.py --modes dropless --impl titan_fold,torchtitan   # torchtitan 0.2.2's layer beside ours
    python bench/moe_layer.py --modes dropless --impl titan_fold,titan_fold_fp8  # FP8 routed experts beside bf16
    torchrun --nproc_per_node 2 bench/moe_layer.py --dispatch ep2,etp2 --name moe_layer_2gpu
    torchrun --nproc_per_node 2 bench/moe_layer.py --dispatch ep2 --shapes qwen2_57b_a14b --shared-overlap on,off
    torchrun --nproc_per_node 2 bench/moe_layer.py --dispatch ep2 --ep-rank-share natural,0.5,0.6,0.7  # imbalance cost
    python bench/moe_layer.py --smoke                           # CPU, tiny shapes (what the tests run)

FLOPs per step (bench.common.moe_layer_flops): 6 * tokens * top_k * 3 * dim * ffn for the
routed experts (times the kept fraction under token drop), plus 6 * tokens * 3 * dim *
shared_ffn for the shared expert, 6 * tokens * dim * num_experts for the router and 6 *
tokens * dim for the shared expert's gate. With ep or etp > 1 every rank holds `tokens`
tokens and, on average over a balanced routing, does the work of that formula, so the
figures are per GPU. The ratio is to the dense bf16 GEMM rate measured in the same run: over 13
products (a burst), and over `--dense-seconds` of them (the rate under sustained load, which a
layer's timed loop of up to seconds of GEMMs also runs under). Each rate and each row records the
SM clock and board power NVML reports right after its timed loop (None without nvidia-ml-py).
Beside them, the memory ceiling: a 1 GiB device-to-device copy's rate (bytes read plus written).

Breakdown (eager, and the step captured in a CUDA graph; torch.profiler over 2 steps): forward
GPU time of each part (router, permute = sort/group, count exchange, all-to-all, all-gather-v,
grouped GEMM, reduce-scatter-v, rest of the dispatcher = row gather + combine, shared expert;
eager only), the GPU time of the whole step (forward + backward) by kernel class, and the span
from a step's first kernel to its last with the time no kernel ran inside it, that idle time
summed by the kernel it came before (in a graph's replay: what the kernels' boundaries cost).
The kernel sum counts NCCL kernels that overlap compute on their own stream, and profiling
slows the host, so compare shares, not the sum with the untraced step time.

Load imbalance over EP ranks (`--ep-rank-share`, ep dispatch only): the router's choices
are remapped so that a set share of all routed assignments lands on EP rank 0's experts
(0.5 = balanced over 2 ranks), keeping each choice's expert index within its rank's block
and its combine weight. The all-to-all makes every rank wait for the busiest one, so the
step time against the share 0.5 row is the time a step loses to that imbalance. `natural`
keeps the router's own choices and only records the share they give.
"""

import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import titan_fold.moe.dispatcher as dispatcher_mod  # noqa: E402
import titan_fold.moe.exchange as exchange_mod  # noqa: E402
from bench.common import (  # noqa: E402
    copy_tbps,
    dense_gemm_tflops,
    gpu_reading,
    graph_of,
    median,
    moe_layer_flops,
    script_parser,
    time_ms,
    write_result,
)
from bench.trace_summary import union_ms  # noqa: E402
from titan_fold.moe import MoE, MoEArgs, moe_stats  # noqa: E402
from titan_fold.parallel.experts import shard_moe  # noqa: E402

SHAPES = {
    # Qwen2-57B-A14B: 64 experts of 2560, top-8, a gated shared expert of 20480
    "qwen2_57b_a14b": dict(dim=3584, ffn=2560, experts=64, top_k=8, shared_ffn=20480, gate=True, norm_topk=False),
    # Mixtral-8x22B: 8 experts of 16384, top-2
    "mixtral_8x22b": dict(dim=6144, ffn=16384, experts=8, top_k=2, shared_ffn=0, gate=False, norm_topk=True),
    # the paper's fine-grained Mixtral-8x22B: 64 experts of 2048, top-8
    "mixtral_8x22b_g8t8": dict(dim=6144, ffn=2048, experts=64, top_k=8, shared_ffn=0, gate=False, norm_topk=True),
    # Qwen3-30B-A3B: 128 experts of 768, top-8, no shared expert
    "qwen3_30b_a3b": dict(dim=2048, ffn=768, experts=128, top_k=8, shared_ffn=0, gate=False, norm_topk=True),
    # CPU smoke test
    "tiny": dict(dim=64, ffn=32, experts=8, top_k=2, shared_ffn=64, gate=True, norm_topk=False),
}
MODES = {"dropless": None, "cf1.0": 1.0}


def build_layer(shape: dict, capacity_factor, device, dtype, impl: str = "titan_fold"):
    if impl == "torchtitan":
        return build_torchtitan_layer(shape, device, dtype)
    args = MoEArgs(
        num_experts=shape["experts"],
        top_k=shape["top_k"],
        moe_ffn_dim=shape["ffn"],
        shared_ffn_dim=shape["shared_ffn"],
        shared_expert_gate=shape["gate"],
        norm_topk_prob=shape["norm_topk"],
        token_drop="dropless" if capacity_factor is None else "drop",
        capacity_factor=capacity_factor,
        expert_kernels={"titan_fold_fp8": "fp8", "titan_fold_quack": "quack"}.get(impl, "torch"),
    )
    torch.manual_seed(0)
    layer = MoE(shape["dim"], args).to(device=device, dtype=dtype)
    layer.init_weights(0.02)
    return layer


def build_torchtitan_layer(shape: dict, device, dtype):
    """torchtitan 0.2.2's MoE layer at the same shape, as its Qwen3 model builds it: softmax
    scores, the top-k renormalized where the shape says so, the score applied after the
    experts, aux-loss-free bias; a shared expert of shared_ffn = num_shared_experts * ffn
    (no sigmoid gate: torchtitan has none)."""
    from torchtitan.models.moe import MoE as TitanMoE
    from torchtitan.models.moe import MoEArgs as TitanMoEArgs

    args = TitanMoEArgs(
        num_experts=shape["experts"],
        num_shared_experts=shape["shared_ffn"] // shape["ffn"],
        score_func="softmax",
        route_norm=shape["norm_topk"],
        top_k=shape["top_k"],
        score_before_experts=False,
    )
    torch.manual_seed(0)
    layer = TitanMoE(args, shape["dim"], shape["ffn"]).to(device=device, dtype=dtype)
    with torch.no_grad():
        layer.init_weights(0.02, device)
    return layer


class RankShareRouter(torch.nn.Module):
    """The layer's router, its choices remapped so that a share `share` of the assignments
    goes to EP rank 0's experts (the rest spread evenly over the other ranks); share None
    keeps the choices. Counts the share it produced (all ranks hold as many tokens, so the
    mean over ranks is the share of the whole EP group's assignments)."""

    def __init__(self, router, share: float | None, ep: int, seed: int):
        super().__init__()
        self.inner, self.share, self.ep, self.seed = router, share, ep, seed
        self.remap = None  # [T, k] EP rank of each assignment: fixed, as the input is
        self.on_rank0 = None  # assignments on rank 0's experts, on the device: no host sync per step
        self.total = 0  # all assignments (known on the host)

    def forward(self, x, *args, **kwargs):
        routing = self.inner(x, *args, **kwargs)
        num_experts = routing.tokens_per_expert.numel()
        per_rank = num_experts // self.ep
        experts = routing.experts  # [T, k]
        if self.share is not None:
            if self.remap is None:
                gen = torch.Generator(device=experts.device).manual_seed(self.seed)
                u = torch.rand(experts.shape, generator=gen, device=experts.device)
                others = 1 + ((u - self.share).clamp(min=0) / (1 - self.share) * (self.ep - 1)).long()
                self.remap = torch.where(u < self.share, 0, others.clamp(max=self.ep - 1))
            experts = self.remap * per_rank + experts % per_rank
            counts = torch.bincount(experts.flatten(), minlength=num_experts).float()
            record = routing.record.clone()
            record[2] = counts.max() / counts.mean()  # the load imbalance of the remapped choices
            routing = dataclasses.replace(routing, experts=experts, tokens_per_expert=counts, record=record)
        with torch.no_grad():
            on_rank0 = (experts < per_rank).sum()
            self.on_rank0 = on_rank0 if self.on_rank0 is None else self.on_rank0 + on_rank0
        self.total += experts.numel()
        return routing

    def observed_share(self) -> float:
        counts = torch.stack([self.on_rank0, torch.tensor(self.total, device=self.on_rank0.device)]).double()
        if dist.is_initialized():
            dist.all_reduce(counts)
        return float(counts[0] / counts[1])


# ---- breakdown ------------------------------------------------------------------------------

_WRAPPED = {  # module-level functions of the dispatcher and its exchanges, each timed as one part
    (dispatcher_mod, "group_by"): "moe::permute_sort",
    (exchange_mod, "group_by"): "moe::permute_sort",
    (exchange_mod, "_a2a"): "moe::all_to_all",
    (dispatcher_mod, "_all_gather_v"): "moe::all_gather_v",
    (dispatcher_mod, "_reduce_scatter_v"): "moe::reduce_scatter_v",
}


@contextlib.contextmanager
def annotated(layer: MoE):
    """Name the parts of the layer's forward with profiler ranges (eager only)."""
    from torch.profiler import record_function

    originals = {(module, fn): getattr(module, fn) for module, fn in _WRAPPED}
    original_splits = dispatcher_mod.TokenDispatcher._splits

    def wrap(fn, label):
        def inner(*a, **k):
            with record_function(label):
                return fn(*a, **k)

        return inner

    for (module, fn), label in _WRAPPED.items():
        setattr(module, fn, wrap(originals[module, fn], label))
    dispatcher_mod.TokenDispatcher._splits = wrap(original_splits, "moe::count_exchange")
    handles, stack = [], []
    parts = {
        "router": layer.router,
        "grouped_gemm": layer.experts,
        "dispatcher": layer.dispatcher,
        "shared_expert": layer.shared_expert,
        "shared_gate": layer.shared_expert_gate,
    }
    for label, module in parts.items():
        if module is None:
            continue

        def pre(_m, _a, label=label):
            rf = record_function(f"moe::{label}")
            rf.__enter__()
            stack.append(rf)

        def post(_m, _a, _o):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for module, fn in _WRAPPED:
            setattr(module, fn, originals[module, fn])
        dispatcher_mod.TokenDispatcher._splits = original_splits


def kernel_class(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(s in n for s in ("gemm", "cutlass", "xmma", "nvjet", "gmma", "matmul", "grouped_mm")):
        return "gemm"
    if any(s in n for s in ("sort", "radix", "scan", "cub::")):
        return "sort_scan"
    if any(s in n for s in ("index", "scatter", "gather")):
        return "index_scatter_gather"
    if n.startswith("triton"):
        return "triton_fused"
    if "functor_add" in n or "functoronself_add" in n:
        return "add"
    if "mulfunctor" in n or "functor_mul" in n:
        return "mul"
    if any(s in n for s in ("reduce", "sum")):
        return "reduce"
    return "elementwise_other"


def _dev_time(evt, on_gpu: bool) -> float:
    """Microseconds of GPU time under evt (kernels it launched and its children's); on the
    CPU, where there are no kernels, its CPU time, so the smoke test sees the same logic."""
    if not on_gpu:
        return evt.cpu_time_total
    return evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total


def profile_step(step, layer, device, steps: int = 2) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with annotated(layer) if isinstance(layer, MoE) else contextlib.nullcontext():
        step()  # warm the wrappers
        if device.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
    events = prof.events()
    on_gpu = device.type == "cuda"
    forward = {}
    # kineto also reports each range as a GPU-side annotation span (a CUDA "event" named
    # like the range): count the ranges once, from their CPU side, and keep the spans out
    # of the kernel sums
    for evt in events:
        if evt.name.startswith("moe::") and evt.device_type == DeviceType.CPU:
            key = evt.name[len("moe::") :]
            forward[key] = forward.get(key, 0.0) + _dev_time(evt, on_gpu) / 1e3 / steps
    inner = ("grouped_gemm", "permute_sort", "count_exchange", "all_to_all", "all_gather_v", "reduce_scatter_v")
    if "dispatcher" in forward:
        forward["dispatcher_rest_gather_combine"] = forward["dispatcher"] - sum(forward.get(k, 0.0) for k in inner)
    kernels, top, launches, spans = {}, {}, 0, []
    for evt in events:
        if evt.device_type == DeviceType.CUDA and not evt.name.startswith("moe::"):
            ms = _dev_time(evt, True) / 1e3 / steps
            cls = kernel_class(evt.name)
            kernels[cls] = kernels.get(cls, 0.0) + ms
            top[evt.name[:160]] = top.get(evt.name[:160], 0.0) + ms
            launches += 1
            spans.append((evt.time_range.start, evt.time_range.end, evt.name))
    busy = sum(kernels.values())
    idle_before = idle_before_kernels(spans, steps)
    spans = [(s, e) for s, e, _ in spans]
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3 / steps if spans else 0.0
    return {
        "forward_ms_by_part": {k: round(v, 3) for k, v in sorted(forward.items())},
        "step_gpu_ms_by_kernel_class": {k: round(v, 3) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])},
        "step_gpu_busy_ms": round(busy, 3),
        # the steps' kernels from the first one's start to the last one's end, and the time in
        # it when none ran (the gap between the profiled steps included)
        "step_gpu_span_ms": round(span, 3),
        "step_gpu_idle_ms": round(span - union_ms(spans) / steps, 3) if spans else 0.0,
        "kernels_per_step": launches / steps,
        "idle_ms_before_kernel": idle_before,
        "top_kernels_ms": {k: round(v, 3) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:24]},
    }


def idle_before_kernels(spans: list[tuple[float, float, str]], steps: int, top: int = 8) -> dict[str, float]:
    """ms per step the GPU idled right before each kernel (spans: start, end us, name), summed by
    the kernel's name, the largest first: in a captured step, what each kernel's start costs."""
    idle, end = {}, None
    for start, stop, name in sorted(spans):
        if end is not None and start > end:
            key = name[:100]
            idle[key] = idle.get(key, 0.0) + (start - end) / 1e3 / steps
        end = stop if end is None else max(end, stop)
    return {k: round(v, 3) for k, v in sorted(idle.items(), key=lambda kv: -kv[1])[:top]}


# ---- one configuration ------------------------------------------------------------------------


def bench_config(
    shape_name, mode, dispatch, compile_modes, a, device, dtype, mesh, overlap=True, impl="titan_fold", rank_share="off"
) -> list[dict]:
    shape = SHAPES[shape_name]
    layer = build_layer(shape, MODES[mode], device, dtype, impl)
    if impl != "torchtitan":
        layer.args.shared_expert_overlap = overlap
    if dispatch != "none":
        ep_mesh = mesh if dispatch.startswith("ep") else None
        etp_mesh = mesh if dispatch.startswith("etp") else None
        shard_moe(layer, ep_mesh, etp_mesh)
    share_router = None
    if rank_share != "off":
        share = None if rank_share == "natural" else float(rank_share)
        share_router = layer.router = RankShareRouter(layer.router, share, mesh.size(), seed=1234 + dist.get_rank())
    b = max(1, a.tokens // a.seq_len)
    gen = torch.Generator(device=device).manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    x = torch.randn(b, a.tokens // b, shape["dim"], device=device, dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    rows = []
    for compiled in compile_modes:
        row = {
            "impl": impl,
            "shape": shape_name,
            "mode": mode,
            "dispatch": dispatch,
            "compiled": compiled,
            "tokens_per_gpu": a.tokens,
            "shared_overlap": overlap,
        }
        if share_router is not None:
            row["ep_rank_share_asked"] = rank_share
        try:
            # every case compiles its fused kernels for its own widths, as a trainer (one model)
            # does: kept from an earlier shape they would be recompiled with dynamic widths, slower
            torch._dynamo.reset()
            fn = torch.compile(layer) if compiled == "compiled" or compiled is True else layer

            def step(fn=fn):
                x.grad = None
                layer.zero_grad(set_to_none=True)
                fn(x).backward(grad)

            if compiled == "graph":  # forward + backward captured once, replayed (no host work per step)
                step = graph_of(step, device)

            moe_stats([layer])  # reset
            times = time_ms(step, a.warmup, a.iters, device)
            reading = gpu_reading(device)
            stats = moe_stats([layer])
            kept = 1.0 - (stats.get("dropped_token_frac") or 0.0)
            gate = shape["gate"] and impl != "torchtitan"
            flops = moe_layer_flops(
                a.tokens,
                shape["dim"],
                shape["ffn"],
                shape["top_k"],
                shape["experts"],
                shape["shared_ffn"],
                gate,
                kept_frac=kept,
            )
            ms = median(times)
            tflops = flops["total"] / (ms * 1e-3) / 1e12
            row.update(
                median_ms=round(ms, 3),
                min_ms=round(min(times), 3),
                max_ms=round(max(times), 3),
                tflops=round(tflops, 3),
                kept_frac=round(kept, 4),
                expert_load_imbalance=round(stats.get("expert_load_imbalance") or 0.0, 3),
                gflop_per_step={k: round(v / 1e9, 4) for k, v in flops.items()},
                routed_tflops=round(flops["routed"] / (ms * 1e-3) / 1e12, 3),
                **reading,
            )
            if share_router is not None:
                row["ep_rank0_share"] = round(share_router.observed_share(), 4)
            if a.dense_tflops:
                row["ratio_to_dense_gemm"] = round(tflops / a.dense_tflops, 3)
            if a.dense_sustained:
                row["ratio_to_dense_sustained"] = round(tflops / a.dense_sustained, 3)
            if compiled in (False, "graph") and a.profile:
                breakdown = profile_step(step, layer, device)
                if compiled == "graph" and not breakdown["kernels_per_step"]:  # no kernel traced in the replays
                    row["breakdown_missing"] = "the profiler recorded no kernel of the graph's replays"
                else:
                    row["breakdown"] = breakdown
        except Exception as e:  # one failing case must not lose the others
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
        _print_row(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _print_row(row):
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    what = (
        f"{row['impl']:10s} {row['shape']:20s} {row['mode']:8s} {row['dispatch']:5s} "
        f"{_mode_name(row['compiled']):8s}"
        f"{'' if row['shared_overlap'] else ' no-overlap'}"
    )
    if "error" in row:
        print(f"{what} ERROR {row['error']}", flush=True)
    else:
        print(
            f"{what} {row['median_ms']:9.3f} ms  {row['tflops']:7.1f} TFLOP/s  ratio {row.get('ratio_to_dense_gemm')}  "
            f"sustained {row.get('ratio_to_dense_sustained')}  kept {row['kept_frac']}",
            flush=True,
        )


def _mode_name(compiled) -> str:
    return compiled if isinstance(compiled, str) else ("compiled" if compiled else "eager")


def parse(argv=None):
    p = script_parser(__doc__, "moe_layer", 3, 10, "tiny shapes on the CPU, eager (for tests)")
    p.add_argument("--shapes", default="qwen2_57b_a14b,mixtral_8x22b,mixtral_8x22b_g8t8,qwen3_30b_a3b")
    p.add_argument(
        "--impl",
        default="titan_fold",
        help="comma list of titan_fold (moe.expert_kernels = torch) | "
        "titan_fold_quack (moe.expert_kernels = quack) | titan_fold_fp8 (routed experts "
        "in FP8, moe.expert_kernels = fp8) | torchtitan (torchtitan 0.2.2's MoE layer at the same shape, dropless, "
        "one GPU), each timed in this process",
    )
    p.add_argument("--modes", default="dropless,cf1.0")
    p.add_argument(
        "--compile",
        default="both",
        choices=["off", "on", "both", "graph", "off_graph", "all"],
        help="eager (off), compiled (on), both, the eager step captured in a CUDA graph (graph), eager "
        "and captured (off_graph), or all three",
    )
    p.add_argument("--dispatch", default="none", help="comma list of none | ep2 | etp2 (needs torchrun with 2 ranks)")
    p.add_argument(
        "--shared-overlap",
        default="on",
        help="comma list of on | off: the shared expert beside the "
        "all-to-all (MoEArgs.shared_expert_overlap); shapes with a shared expert only for off",
    )
    p.add_argument(
        "--ep-rank-share",
        default="off",
        help="comma list of off | natural | a share in [0.5, 1): "
        "routed assignments remapped so that this share lands on EP rank 0's experts (ep dispatch only)",
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step (seq 4096 x batch 2)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument(
        "--dense-seconds",
        type=float,
        default=2.0,
        help="also time the dense GEMM for this long "
        "(the sustained rate and each row's share of it); 0: the burst only",
    )
    p.add_argument("--no-profile", dest="profile", action="store_false")
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.shapes, a.tokens, a.seq_len, a.warmup, a.iters = "cpu", "tiny", 256, 128, 1, 2
        a.compile = "off" if a.compile == "both" else a.compile
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16
    mesh = None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("x",))
    elif device.type == "cuda":
        device = torch.device("cuda", 0)
    on_gpu = device.type == "cuda"
    a.dense_tflops = dense_gemm_tflops(device) if on_gpu else None
    readings = {"burst": gpu_reading(device)}
    a.dense_sustained = dense_gemm_tflops(device, seconds=a.dense_seconds) if on_gpu and a.dense_seconds else None
    readings["sustained"] = gpu_reading(device) if a.dense_sustained else {}
    copy = round(copy_tbps(device), 3) if on_gpu else None
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            f"dense bf16 GEMM 8192^3: {a.dense_tflops} TFLOP/s, over {a.dense_seconds} s: {a.dense_sustained}; "
            f"copy: {copy} TB/s",
            flush=True,
        )
    compile_modes = {
        "off": [False],
        "on": [True],
        "both": [False, True],
        "graph": ["graph"],
        "off_graph": [False, "graph"],
        "all": [False, True, "graph"],
    }[a.compile]
    rows = []
    figures = {
        "dense_bf16_gemm_tflops": a.dense_tflops,
        "dense_bf16_gemm_tflops_sustained": a.dense_sustained,
        "dense_seconds": a.dense_seconds,
        "dense_sm_clock_mhz": {k: r.get("sm_clock_mhz") for k, r in readings.items()},
        "dense_power_w": {k: r.get("power_w") for k, r in readings.items()},
        "copy_tbps": copy,
        "dtype": "bfloat16",
        "tokens_per_gpu": a.tokens,
        "seq_len": a.seq_len,
        "warmup": a.warmup,
        "iters": a.iters,
        "world_size": world,
        "rows": rows,
    }
    for dispatch in a.dispatch.split(","):
        if dispatch != "none" and mesh is None:
            raise SystemExit(f"--dispatch {dispatch} needs torchrun --nproc_per_node 2")
        for shape_name in a.shapes.split(","):
            for mode in a.modes.split(","):
                for impl in a.impl.split(","):
                    if impl == "torchtitan" and (mode != "dropless" or dispatch != "none"):
                        continue  # its layer is dropless; its EP lives in its parallelize step
                    for overlap in a.shared_overlap.split(","):
                        if overlap == "off" and (not SHAPES[shape_name]["shared_ffn"] or impl == "torchtitan"):
                            continue
                        for share in a.ep_rank_share.split(","):
                            if share != "off" and (not dispatch.startswith("ep") or impl == "torchtitan"):
                                raise SystemExit("--ep-rank-share needs --dispatch ep2 and titan_fold's layer")
                            rows += bench_config(
                                shape_name,
                                mode,
                                dispatch,
                                compile_modes,
                                a,
                                device,
                                dtype,
                                mesh,
                                overlap=overlap == "on",
                                impl=impl,
                                rank_share=share,
                            )
                if not dist.is_initialized() or dist.get_rank() == 0:
                    write_result(a.name, figures, a.out_dir)  # after every case: a cut-off run keeps what it had
    if dist.is_initialized():
        dist.destroy_process_group()
    return figures


if __name__ == "__main__":
    main()
