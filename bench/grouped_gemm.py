"""The routed experts' grouped GEMMs alone: the bound they set on the MoE layer (1 GPU).

    python bench/grouped_gemm.py                                  # GPU, bf16, the four shapes, 8192 tokens
    python bench/grouped_gemm.py --autotune qwen3_30b_a3b         # + inductor max-autotune of its six GEMMs
    python bench/grouped_gemm.py --impl quack --shapes qwen3_30b_a3b   # moe/quack.py's GEMMs (sm90+, QuACK)
    python bench/grouped_gemm.py --smoke                          # CPU, tiny shape (what the tests run)

Per shape (bench/moe_layer.py's SHAPES), R = tokens * top_k rows, each assigned to an
expert (--counts below), grouped by expert (offsets: int32 cumulative counts),
as the dispatcher hands them to titan_fold.moe.experts. Every figure is a median of CUDA
event times after warm-up, beside the dense bf16 8192^3 GEMM rate of the same process.

The six grouped GEMMs are timed on the very operands autograd passes to _grouped_mm in
one forward + backward of torch._grouped_mm(x, w.transpose(1, 2), offs) at the shape
(their [shape, stride] in "operand_layouts"): for up (x [R, dim], w13 [E, 2 * ffn, dim], the
gate and up projections of moe/experts.py in one weight) and down (h [R, ffn], w2 [E, dim,
ffn]), with w [E, N, K] and g = dL/dy [R, N], torch
2.13 passes
  fwd    y [R, N]    = _grouped_mm(x, w.transpose(1, 2), offs)   per group x_e @ w_e.T
  dgrad  dx [R, K]   = _grouped_mm(g, w, offs)                   per group g_e @ w_e
  wgrad  dw [E, N, K] = _grouped_mm(g.t(), x, offs)              per group g_e.T @ x_e (offs over K = R)
Each costs 2 * R * K * N FLOPs. Beside them, torch.bmm of the same operands in E equal
groups of R // E rows (fwd and wgrad): what cuBLAS gives the batched shape without the
raggedness.

The bound: titan_fold runs the routed experts as six grouped GEMMs per step, up (w13, width
2 * ffn) and down fwd/dgrad/wgrad, FLOPs 6 * R * 3 * dim * ffn (bench.common.moe_layer_flops'
"routed"); gemm_gflop_each is 2 * R * dim * ffn, the up GEMMs do twice that.
  gemm_bound_share              routed FLOPs / the six GEMMs' ms / dense rate:
                                the routed experts' share of the dense rate if only their
                                GEMMs took time (no SwiGLU)
  gemm_bound_share_with_shared  the same with the shared expert (6 * tokens * 3 * dim *
                                shared_ffn FLOPs) added to the FLOPs and, at the dense rate,
                                to the time (equals gemm_bound_share without one)
  layer_bound_share             every FLOP bench/moe_layer.py counts (routed, shared, router,
                                shared gate) over the same time: the highest
                                ratio_to_dense_gemm bench/moe_layer.py could report at this
                                shape if the router, gate, dispatch, SwiGLU and every other
                                kernel took no time and the shared expert ran at the dense rate
  share_of_roofline             the six GEMMs' least time over their time: each GEMM's least
                                time is its FLOPs at the dense rate or its fewest bytes
                                (gemm_bytes) at a 1 GiB copy's rate, whichever is longer; per
                                GEMM gb, bound_ms, bound_by (memory or compute), share_of_bound.
                                At R / E rows per expert a GEMM does R / E FLOPs per byte of its
                                weights (512 at Qwen3-30B-A3B shapes, 8192 tokens), within a
                                few times of the rates' ratio (about 190 FLOPs per byte on an
                                H200, 265 on an H100): there the bytes weigh beside the FLOPs
Each GEMM is timed alone, repeated on the same operands (at the four shapes every operand
is larger than the GPU's L2 cache), with the kernel PyTorch picks for these layouts.

--impl quack: the same six products as moe.expert_kernels = "quack" runs them (moe/quack.py, each
call alone on its own operands): up fwd gathers the tokens' rows itself (x [tokens, dim] and the
row index) and applies the SwiGLU times the routing weight in its epilogue, down dgrad applies
the SwiGLU's backward in its epilogue (gemm_dgated), the wgrads are varlen-K. Those two carry
work torch's path runs as separate passes, so QuACK's bound counts the SwiGLU and torch's does
not.

--counts: the rows per expert, "drawn" (each of the tokens * top_k assignments drawn uniformly
over the experts, as a router with balanced scores gives) or "equal" (R / E each, as equal as R
allows). A grouped GEMM covers each expert's rows with whole tiles of rows: drawn counts leave
a part-filled tile in most experts, equal ones that are a multiple of the tile none, so the two
side by side show what the raggedness costs at the shape.

--autotune SHAPES: the six GEMMs of those shapes compiled with torch.compile(mode=
"max-autotune-no-cudagraphs") (inductor's Triton grouped GEMM templates against the ATen
kernel): ms, TFLOP/s, seconds spent compiling, and the largest difference from eager.
"""

import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import copy_tbps, dense_gemm_tflops, median, moe_layer_flops, script_parser, time_ms, write_result  # noqa: E402
from bench.moe_layer import SHAPES  # noqa: E402

GEMM_SHAPES = ("qwen2_57b_a14b", "mixtral_8x22b", "mixtral_8x22b_g8t8", "qwen3_30b_a3b")
OPS = ("fwd", "dgrad", "wgrad")
IMPLS = ("torch", "quack")
COUNTS = ("drawn", "equal")


def gemm(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


def autograd_operands(R, K, N, E, offs, device, dtype, gen):
    """The three grouped GEMMs of a layer x [R, K] -> [R, N] with weight w [E, N, K], as
    autograd runs them: one forward + backward of gemm(x, w.transpose(1, 2), offs) recorded,
    fwd (the first call), dgrad (the backward's [R, K] output) and wgrad (its [E, ., .] one)
    -> their (a, b), each timed as gemm(a, b, offs); plus x, w, g = dL/dy for the bmm."""
    x = torch.randn(R, K, device=device, dtype=dtype, generator=gen)
    w = torch.randn(E, N, K, device=device, dtype=dtype, generator=gen) * K**-0.5
    g = torch.randn(R, N, device=device, dtype=dtype, generator=gen)
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    with _GroupedMMCalls() as calls:
        torch.autograd.backward(gemm(xl, wl.transpose(1, 2), offs), g)
    ops = {
        "fwd" if i == 0 else "dgrad" if out.dim() == 2 else "wgrad": (a, b) for i, (a, b, out) in enumerate(calls.calls)
    }
    if len(calls.calls) != 3 or set(ops) != set(OPS):
        raise RuntimeError(f"autograd ran {len(calls.calls)} grouped GEMMs, not fwd, dgrad, wgrad")
    return {op: ops[op] for op in OPS}, (x, w, g)


def layout(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride())]


def gemm_flops(R, K, N):
    return 2 * R * K * N


def expert_gemm_flops(name: str, R, dim, ffn):
    """FLOPs of one of the six GEMMs by name: the up ones (w13, width 2 * ffn) twice the down ones."""
    return (2 if name.startswith("up_") else 1) * gemm_flops(R, dim, ffn)


class _GroupedMMCalls(TorchDispatchMode):
    """Keeps (a, b, output) of every _grouped_mm call, detached (same storage and strides)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._grouped_mm.default:
            self.calls.append((args[0].detach(), args[1].detach(), out))
        return out


def rel_diff(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


# ---- one shape --------------------------------------------------------------------------------


def routing(tokens, top_k, E, counts="drawn", seed=0):
    """tokens * top_k assignments to E experts, drawn uniformly ("drawn") or R / E to each in a
    random order ("equal") -> (rows [R], the token each routed row reads, grouped by expert;
    counts [E], rows per expert)."""
    gen = torch.Generator().manual_seed(seed)
    R = tokens * top_k
    experts = torch.randint(0, E, (R,), generator=gen) if counts == "drawn" else torch.randperm(R, generator=gen) % E
    return torch.sort(experts, stable=True).indices // top_k, torch.bincount(experts, minlength=E)


def quack_missing(device: torch.device) -> str | None:
    """Why moe/quack.py's GEMMs cannot run here, or None."""
    from titan_fold.moe.quack import quack_problem

    return quack_problem(device.index) if device.type == "cuda" else "needs a CUDA GPU"


def quack_gemms(tokens, rows, per_expert, dim, ffn, E, device, dtype, gen) -> tuple[dict, dict]:
    """The six GEMMs of one layer's experts as moe/quack.py calls them, each a function of its
    own operands (module docstring): {up_fwd, up_dgrad, up_wgrad, down_fwd, down_dgrad, down_wgrad};
    and the four varlen-M ones (up_fwd, up_dgrad, down_fwd, down_dgrad) with the config QuACK's
    frontends tune for them (moe/quack.py re-times its sweep's fastest: _choose)."""
    import titan_fold.moe.quack as qm

    q, R = qm.quack(), rows.shape[0]
    rows, offs = rows.to(device=device, dtype=torch.int32), qm.offsets(per_expert.to(device))
    x = torch.randn(tokens, dim, device=device, dtype=dtype, generator=gen)
    w13 = torch.randn(E, 2 * ffn, dim, device=device, dtype=dtype, generator=gen) * dim**-0.5
    w2 = torch.randn(E, dim, ffn, device=device, dtype=dtype, generator=gen) * ffn**-0.5
    p = torch.rand(R, device=device, generator=gen)
    dy = torch.randn(R, dim, device=device, dtype=dtype, generator=gen)
    ab, h = qm._up_forward(x, rows, offs, w13, p)  # [R, 2 * ffn], [R, ffn]
    dab = qm._dgated(q, dy, ab, p, offs, w2)[0]  # [R, 2 * ffn]
    x_rows = x[rows]  # the up wgrad's rows, gathered before it as in the experts' backward
    ab_q, h_q, dx_q, y_q = torch.empty_like(ab), torch.empty_like(h), torch.empty_like(dy), torch.empty_like(dy)
    plain = lambda a, b, out: q.gemm_tuned(a, b, out, None, cu_seqlens_m=offs, dynamic_scheduler=True)  # noqa: E731
    gemms = {
        "up_fwd": lambda: qm._up_forward(x, rows, offs, w13, p),
        "up_dgrad": lambda: qm._varlen_m(q, dab, w13, offs),
        "up_wgrad": lambda: qm._wgrad(q, dab, x_rows, offs),
        "down_fwd": lambda: qm._down_forward(h, offs, w2),
        "down_dgrad": lambda: qm._dgated(q, dy, ab, p, offs, w2),
        "down_wgrad": lambda: qm._wgrad(q, dy, h, offs),
    }
    quack_tuned = {
        "up_fwd": lambda: qm._up_launch(x, w13.mT, ab_q, h_q, offs, rows, p),
        "up_dgrad": lambda: plain(dab, w13, dx_q),
        "down_fwd": lambda: plain(h, w2.mT, y_q),
        "down_dgrad": lambda: qm._dgated_launch(dy, w2, ab, p, offs),
    }
    return gemms, quack_tuned


def bounds(gemm_ms: dict, tokens: int, shape: dict, dense: float) -> dict:
    """The shares of the dense rate the routed GEMMs allow (module docstring), from the ms of
    each of the six GEMMs (up_fwd ... down_wgrad) at this shape and tokens."""
    f = moe_layer_flops(
        tokens, shape["dim"], shape["ffn"], shape["top_k"], shape["experts"], shape["shared_ffn"], shape["gate"]
    )
    routed_ms = sum(gemm_ms.values())
    shared_ms = f["shared"] / (dense * 1e12) * 1e3
    tflops = lambda flop, ms: flop / (ms * 1e-3) / 1e12  # noqa: E731
    return {
        "routed_gemms_ms": routed_ms,
        "routed_gemms_tflops": tflops(f["routed"], routed_ms),
        "shared_at_dense_ms": shared_ms,
        "gemm_bound_share": tflops(f["routed"], routed_ms) / dense,
        "gemm_bound_share_with_shared": tflops(f["routed"] + f["shared"], routed_ms + shared_ms) / dense,
        "layer_bound_share": tflops(f["total"], routed_ms + shared_ms) / dense,
    }


def bench_gemms(K, N, R, E, offs, a, autotune, device, dtype, gen) -> dict:
    """One layer's fwd, dgrad, wgrad grouped GEMMs [R, K] -> [R, N] (ms, TFLOP/s, operand
    layouts), bmm on equal groups, and with autotune, max-autotune of each."""
    flops = gemm_flops(R, K, N)
    ops, (x, w, g) = autograd_operands(R, K, N, E, offs, device, dtype, gen)
    out = {"gemms": {}, "layouts": {}, "bmm": {}, "autotune": {}, "compile_s": 0.0}
    for op, (lhs, rhs) in ops.items():
        out["layouts"][op] = [layout(lhs), layout(rhs)]
        ms = median(time_ms(lambda lhs=lhs, rhs=rhs: gemm(lhs, rhs, offs), a.warmup, a.iters, device))
        out["gemms"][op] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
    C = R // E
    xb, gb = x[: E * C].view(E, C, K), g[: E * C].view(E, C, N)
    for op, (lhs, rhs) in (("fwd", (xb, w.transpose(1, 2))), ("wgrad", (gb.transpose(1, 2), xb))):
        ms = median(time_ms(lambda lhs=lhs, rhs=rhs: torch.bmm(lhs, rhs), a.warmup, a.iters, device))
        out["bmm"][op] = {"ms": ms, "tflops": gemm_flops(E * C, K, N) / (ms * 1e-3) / 1e12}
    if autotune:
        compiled = torch.compile(gemm, mode="max-autotune-no-cudagraphs", dynamic=False)
        for op, (lhs, rhs) in ops.items():
            t0 = time.perf_counter()
            got = compiled(lhs, rhs, offs)  # compiles and autotunes for this layout
            torch.cuda.synchronize(device)
            out["compile_s"] += time.perf_counter() - t0
            ms = median(time_ms(lambda lhs=lhs, rhs=rhs: compiled(lhs, rhs, offs), a.warmup, a.iters, device))
            out["autotune"][op] = {
                "ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12,
                "max_rel_diff": rel_diff(gemm(lhs, rhs, offs), got),
            }
    return out


def bench_shape(name, shape, a, device, dtype, dense, copy, counts="drawn", impl="torch") -> dict:
    dim, ffn, E, k = shape["dim"], shape["ffn"], shape["experts"], shape["top_k"]
    R = a.tokens * k
    rows, per_expert = routing(a.tokens, k, E, counts)
    gen = torch.Generator(device=device).manual_seed(1)
    row = {
        "shape": name,
        "counts": counts,
        "impl": impl,
        "tokens": a.tokens,
        "rows": R,
        "dim": dim,
        "ffn": ffn,
        "experts": E,
        "top_k": k,
        "shared_ffn": shape["shared_ffn"],
        "rows_per_expert_min": int(per_expert.min()),
        "rows_per_expert_max": int(per_expert.max()),
        "gemm_gflop_each": gemm_flops(R, dim, ffn) / 1e9,
        "gemms": {},
    }
    autotune, compile_s = {}, 0.0
    if impl == "quack":
        gemms, quack_tuned = quack_gemms(a.tokens, rows, per_expert, dim, ffn, E, device, dtype, gen)
        for n, fn in gemms.items():
            ms = median(time_ms(fn, a.warmup, a.iters, device))
            row["gemms"][n] = {"ms": ms, "tflops": expert_gemm_flops(n, R, dim, ffn) / (ms * 1e-3) / 1e12}
        row["tunings"] = tunings(
            {n: {"titan_fold": gemms[n], "quack": fn} for n, fn in quack_tuned.items()},
            a,
            device,
            {n: expert_gemm_flops(n, R, dim, ffn) for n in quack_tuned},
        )
    else:
        offs = per_expert.cumsum(0).to(device=device, dtype=torch.int32)  # torch._grouped_mm's: each group's end
        row.update(bmm_equal_groups={}, operand_layouts={})
        for layer, (K, N) in (("up", (dim, 2 * ffn)), ("down", (ffn, dim))):
            got = bench_gemms(K, N, R, E, offs, a, name in a.autotune, device, dtype, gen)
            for key, into in (
                ("gemms", row["gemms"]),
                ("bmm", row["bmm_equal_groups"]),
                ("layouts", row["operand_layouts"]),
                ("autotune", autotune),
            ):
                into.update({f"{layer}_{op}": v for op, v in got[key].items()})
            compile_s += got["compile_s"]
    row.update(bounds({n: v["ms"] for n, v in row["gemms"].items()}, a.tokens, shape, dense))
    row.update(roofline(row["gemms"], gemm_bytes(R, E, dim, ffn, impl), R, dim, ffn, dense, copy))
    if autotune:
        row["autotune"], row["autotune_compile_s"] = autotune, compile_s
        best = bounds({n: min(v["ms"], autotune[n]["ms"]) for n, v in row["gemms"].items()}, a.tokens, shape, dense)
        row["autotune_best_routed_gemms_tflops"] = best["routed_gemms_tflops"]
        row["autotune_best_gemm_bound_share"] = best["gemm_bound_share"]
    return row


def tunings(fns: dict, a, device, flops: dict, rounds: int = 3) -> dict:
    """Each varlen-M GEMM {name: {"titan_fold": fn, "quack": fn}} with moe/quack.py's config and
    with the config QuACK's frontend tunes, timed in turn (rounds x each GEMM and tuning):
    {name: {tuning: {ms, tflops}, "quack_over_titan_fold": time ratio}, "varlen_m": the same ratio
    of their summed times}."""
    ms = {(g, t): [] for g, pair in fns.items() for t in pair}
    for _ in range(rounds):
        for g, t in ms:
            ms[g, t].append(median(time_ms(fns[g][t], a.warmup, a.iters, device)))
    out = {
        g: {t: {"ms": median(ms[g, t]), "tflops": flops[g] / (median(ms[g, t]) * 1e-3) / 1e12} for t in pair}
        for g, pair in fns.items()
    }
    for g in fns:
        out[g]["quack_over_titan_fold"] = out[g]["quack"]["ms"] / out[g]["titan_fold"]["ms"]
    total = {t: sum(out[g][t]["ms"] for g in fns) for t in ("titan_fold", "quack")}
    out["varlen_m"] = {
        **{f"{t}_ms": v for t, v in total.items()},
        "quack_over_titan_fold": total["quack"] / total["titan_fold"],
    }
    return out


def gemm_bytes(R, E, dim, ffn, impl="torch") -> dict[str, int]:
    """The fewest bytes each of the six GEMMs moves: every operand read once and every output
    written once (bf16 rows and weights; the routing weight and its gradient float32). QuACK's
    epilogues add to two: up fwd also reads p and writes h [R, ffn]; down dgrad also reads the
    (gate, up) pairs and p, and writes their gradient [R, 2 * ffn], h and dp where torch's writes dh
    [R, ffn]."""
    x, ab, h = 2 * R * dim, 4 * R * ffn, 2 * R * ffn  # rows of x (or dy), of (gate, up), of h (or dh)
    w13, w2 = 4 * E * ffn * dim, 2 * E * dim * ffn
    out = {
        "up_fwd": x + w13 + ab,
        "up_dgrad": ab + w13 + x,
        "up_wgrad": ab + x + w13,
        "down_fwd": h + w2 + x,
        "down_dgrad": x + w2 + h,
        "down_wgrad": x + h + w2,
    }
    if impl == "quack":
        out["up_fwd"] += h + 4 * R
        out["down_dgrad"] += 2 * ab + 8 * R
    return out


def roofline(gemms: dict, nbytes: dict, R, dim, ffn, dense: float, copy: float) -> dict:
    """Each GEMM's least time, its FLOPs at the dense rate or its bytes at the copy rate (TB/s),
    whichever is longer: gemms[name] gains gb, bound_ms and share_of_bound (bound_ms over its ms,
    "memory" or "compute" in bound_by); -> the six bounds' sum and the share of it the six reach."""
    for n, g in gemms.items():
        flop_ms = expert_gemm_flops(n, R, dim, ffn) / (dense * 1e12) * 1e3
        byte_ms = nbytes[n] / (copy * 1e12) * 1e3
        g.update(
            gb=nbytes[n] / 1e9, bound_ms=max(flop_ms, byte_ms), bound_by="memory" if byte_ms > flop_ms else "compute"
        )
        g["share_of_bound"] = g["bound_ms"] / g["ms"]
    bound = sum(g["bound_ms"] for g in gemms.values())
    return {"copy_tbps": copy, "roofline_ms": bound, "share_of_roofline": bound / sum(g["ms"] for g in gemms.values())}


def _print_row(row):
    what = f"[grouped_gemm] {row['shape']} {row['counts']} {row['impl']}"
    if "error" in row:
        print(f"{what} ERROR {row['error']}", flush=True)
        return
    tf = " ".join(f"{n} {v['tflops']:.1f}" for n, v in row["gemms"].items())
    print(
        f"{what}: TFLOP/s {tf}; bound share {row.get('gemm_bound_share')} "
        f"(with shared {row.get('gemm_bound_share_with_shared')}); share of roofline {row.get('share_of_roofline')}",
        flush=True,
    )


def parse(argv=None):
    p = script_parser(__doc__, "grouped_gemm", 5, 20, "CPU, tiny shape, 64 tokens (for tests)")
    p.add_argument("--shapes", default=",".join(GEMM_SHAPES), help="comma list of bench/moe_layer.py's SHAPES")
    p.add_argument(
        "--impl",
        default=",".join(IMPLS),
        help="comma list of torch (torch._grouped_mm) | quack "
        "(moe/quack.py's calls; left out, with the reason, where QuACK cannot run)",
    )
    p.add_argument("--counts", default=",".join(COUNTS), help="comma list of drawn | equal: rows per expert")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step")
    p.add_argument(
        "--autotune",
        default="",
        help="comma list of shapes whose six GEMMs are also compiled with "
        "max-autotune (CUDA only; about 100 s a shape)",
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.shapes, a.tokens, a.warmup, a.iters = "cpu", "tiny", 64, 1, 2
    a.shapes, a.impl, a.counts = a.shapes.split(","), a.impl.split(","), a.counts.split(",")
    for flag, got, known in (("--impl", a.impl, IMPLS), ("--counts", a.counts, COUNTS)):
        if set(got) - set(known):
            p.error(f"{flag}: unknown {sorted(set(got) - set(known))[0]} (one of {', '.join(known)})")
    a.autotune = [s for s in a.autotune.split(",") if s]
    unknown = [s for s in a.shapes + a.autotune if s not in SHAPES]
    if unknown:
        p.error(f"--shapes/--autotune: unknown shape {unknown[0]} (one of {', '.join(SHAPES)})")
    if a.autotune and not a.device.startswith("cuda"):
        p.error("--autotune: max-autotune needs CUDA")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
    dtype = torch.bfloat16
    dense_n = 8192 if device.type == "cuda" else 256  # the CPU's rate only exercises the arithmetic
    dense = dense_gemm_tflops(device, n=dense_n)
    copy = copy_tbps(device, nbytes=1 << (30 if device.type == "cuda" else 20))
    print(f"[grouped_gemm] dense bf16 GEMM {dense_n}^3: {dense} TFLOP/s; copy {copy} TB/s", flush=True)
    rows = []
    figures = {
        "dense_bf16_gemm_tflops": dense,
        "dense_gemm_n": dense_n,
        "copy_tbps": copy,
        "dtype": "bfloat16",
        "tokens": a.tokens,
        "warmup": a.warmup,
        "iters": a.iters,
        "rows": rows,
    }
    impls = a.impl
    if "quack" in impls and (missing := quack_missing(device)):
        figures["quack_left_out"], impls = missing, [i for i in impls if i != "quack"]
        print(f"[grouped_gemm] quack left out: {missing}", flush=True)
    for name in a.shapes:
        for counts in a.counts:
            for impl in impls:
                # each shape compiles its autotuned GEMMs for its own widths
                torch._dynamo.reset()
                try:
                    row = bench_shape(name, SHAPES[name], a, device, dtype, dense, copy, counts, impl)
                except Exception as e:  # one failing case must not lose the others
                    row = {
                        "shape": name,
                        "counts": counts,
                        "impl": impl,
                        "error": f"{type(e).__name__}: {str(e)[:400]}",
                    }
                rows.append(row)
                _print_row(row)
                write_result(a.name, figures, a.out_dir)  # after every case: a cut-off run keeps what it had
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return figures


if __name__ == "__main__":
    main()
