"""Routed experts on QuACK's grouped GEMMs (`moe.expert_kernels = "quack"`): sm90+ GPUs, bf16.

QuACK (`pip install -e ".[quack]"`, CuTe-DSL kernels) runs grouped GEMMs whose group offsets
live on the device: varlen-M (`cu_seqlens_m`, one group of rows per expert) for the forward and
input-gradient products, varlen-K (`cu_seqlens_k`) for the weight gradients, and it gathers the
rows of its left operand itself (`A_idx`). Per layer, w13 holding each expert's gate and up rows
alternating (moe/experts.py):

    forward   ab = x[rows] @ w13[e].T                        one GEMM: the gather fused (no
              h = silu(gate) * up * p                        [R, dim] copy of the tokens made or
                                                             saved), the SwiGLU times p in its
                                                             epilogue (moe/quack_epilogue.py)
              y = h @ w2[e].T
    backward  dab, h, dp from (dy @ w2[e], ab, p)            one GEMM, the SwiGLU's backward in
                                                             its epilogue (QuACK's gemm_dgated)
              dw2 = dy^T h, dw13 = dab^T x[rows]             varlen-K
              dx_rows = dab @ w13[e]
              dx = each token's rows summed (the caller's row sum)

The up projection writes both ab and h; the gated backward recomputes h from ab, so the
forward saves ab and not h, and takes the routing weight p as its row scale and p's gradient as
its row sum (p applied before w2; with p applied after w2 the experts run with p = 1 and the
caller scales their output).

The backward copies x[rows] once for the weight gradient, and the gradient's rows once (the
caller's combine backward), rather than reading them in place: QuACK gathers rows with
cp.async loads instead of TMA, and at Qwen3-30B-A3B shapes on an H200 each GEMM reading its
rows in place ran slower than one gather and the plain GEMMs together (down projection: even;
the up projection's weight gradient, which must be computed transposed to gather: slower by
more than the gather).

Each GEMM's forward and backward is a custom op: torch.compile sees opaque calls with known
output shapes, and the weights arrive as plain local tensors (FSDP2 and EP/ETP shards as for
the torch path). Eager code calls their implementations directly, and each plain GEMM replays
the launch QuACK resolved for the config chosen at its signature's first call (_gemm, _choose):
the fine-grained layer's eager forward is host-bound, and both cut host time per call
(bench/launch.py).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Protocol, cast

import torch

from titan_fold.moe.exchange import resolve

CHOICES = ("auto", "torch", "quack")


@dataclass
class Gather:
    """Routed rows read from the tokens in place: row i is x[rows[i]] (rows grouped by expert),
    and row_sum(g [R, dim], slot, k) -> [T, dim] sums each token's k rows of a gradient, slot [T *
    k] being the row of each (token, choice). A module-level function, so torch.compile can
    trace the backward that calls it."""

    rows: torch.Tensor
    slot: torch.Tensor
    k: int
    row_sum: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


_ALIGN = 8  # bf16 elements per 16 bytes: QuACK's operands need 16-byte aligned rows
# Every GEMM's CTAs claim their tiles from a counter rather than in a fixed round-robin: the
# experts' groups differ in rows (varlen-M) and in K (varlen-K), so fixed shares leave SMs idle
# at a GEMM's end. The tiles and their sums are the same either way (no split-K): same bits.
_SCHED = {"dynamic_scheduler": True}


def _import_quack():
    try:
        from quack import gemm_interface
    except Exception:  # not installed, or its CUDA libraries do not load here
        return None, None
    try:
        from titan_fold.moe.quack_epilogue import swiglu_times_p
    except Exception:  # a QuACK without the epilogue frontend
        return gemm_interface, None
    return gemm_interface, swiglu_times_p


_QUACK = _UP_EPILOGUE = None
_LOADED = False


def _load():
    global _QUACK, _UP_EPILOGUE, _LOADED
    if not _LOADED:
        (_QUACK, _UP_EPILOGUE), _LOADED = _import_quack(), True


def quack():
    """QuACK's gemm interface, or None where it is not installed (imported once)."""
    _load()
    return _QUACK


def up_epilogue():
    """The up projection's GEMM with the SwiGLU times p in its epilogue (moe/quack_epilogue.py),
    or None where QuACK is not installed."""
    _load()
    return _UP_EPILOGUE


# a constant to torch.compile: evaluated when traced, not traced (its device query,
# torch.cuda.get_device_capability, would break the MoE layer's graph where "auto" asks)
@torch.compiler.assume_constant_result
def quack_problem(device_index: int | None = None) -> str | None:
    """Why the QuACK experts cannot run on this machine's GPU (for a config error), or None."""
    if device_index not in _PROBLEMS:
        _PROBLEMS[device_index] = _problem(device_index)
    return _PROBLEMS[device_index]


_PROBLEMS: dict = {}


def _problem(device_index: int | None) -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    capability = torch.cuda.get_device_capability(device_index)
    if capability < (9, 0):
        return f"needs an sm90 (Hopper) GPU or newer; this GPU is sm{capability[0]}{capability[1]}"
    q = quack()
    if q is None:
        return 'needs quack-kernels (pip install -e ".[quack]")'
    names = ("gemm_tuned", "_gemm_execute", "gemm_dgated", "RoundingMode", "SplitKMode")
    if up_epilogue() is None or not all(hasattr(q, name) for name in names):
        return (
            f'needs quack-kernels 0.6 (pip install -e ".[quack]"; installed: {_version()}): moe/quack.py replays '
            "its launches, calls gemm_dgated and writes an epilogue on its GEMM frontend"
        )
    return None


def _version() -> str:
    try:
        return version("quack-kernels")
    except PackageNotFoundError:
        return "unknown"


def varying_rows(args, ep: int, etp: int) -> str | None:
    """What gives the routed experts a new row count in every layer call under these MoEArgs and
    degrees (the setting, for messages), or None where the count is fixed. QuACK tunes its kernels
    for every new count (its autotuner keys on the operands' shapes): there it would tune in every
    layer and step, so "auto" takes torch's GEMMs and "quack" is refused."""
    if args.token_drop == "drop":
        return f"moe.token_drop = 'drop' (moe.capacity_factor = {args.capacity_factor}, unpadded)"
    if args.token_drop == "drop_and_pad":
        return None
    if ep * etp > 1 and resolve(args.exchange, ep, etp) == "exact":
        return (
            f"the exact exchange over parallelism.expert_parallel_degree x expert_tensor_parallel_degree = "
            f"{ep} x {etp} (moe.exchange = {args.exchange!r})"
        )
    return None


def use_quack(choice: str, x: torch.Tensor, ffn: int) -> bool:
    """Whether rows x go through QuACK: "torch" never; "quack" where installed and the inputs suit
    it (an error where they do not); "auto" likewise (torch's GEMMs where they do not), eager
    included: with its launches replayed (_gemm) a QuACK call costs the host close to what a
    torch._grouped_mm call does, and its GEMMs are faster (docs/benchmarks.md)."""
    if choice == "torch":
        return False
    problem = None
    if not x.is_cuda:
        problem = "runs on CUDA tensors only"
    elif x.dtype != torch.bfloat16:
        problem = f"takes bf16 rows (got {x.dtype}): set training.mixed_precision_param or training.dtype to bfloat16"
    elif x.shape[-1] % _ALIGN or ffn % _ALIGN:
        problem = (
            f"needs the model width ({x.shape[-1]}) and the expert width per etp rank ({ffn}) divisible by {_ALIGN}"
        )
    else:
        problem = quack_problem(x.device.index)
    if problem is not None and choice == "quack":
        raise RuntimeError(f"moe.expert_kernels = 'quack' {problem}")
    return problem is None


class _EagerOp(Protocol):
    """What _op makes of a function: called like it, and the custom op's register_fake."""

    register_fake: Callable[..., Any]

    def __call__(self, *args: Any) -> Any: ...


def _op(name: str) -> Callable[[Callable[..., Any]], _EagerOp]:
    """fn registered as the custom op titan_fold::<name>, returned as a function that records
    that op where it is traced (torch.compile, fake or functional tensors: an opaque call with
    the shapes register_fake gives) and runs fn itself on plain tensors in eager code, where the
    dispatcher's round trip would add host time to every call (bench/launch.py) in a layer whose
    eager forward is host-bound."""

    def wrap(fn: Callable[..., Any]) -> _EagerOp:
        op = torch.library.custom_op(f"titan_fold::{name}", fn, mutates_args=(), device_types="cuda")

        def call(*args):
            if torch.compiler.is_compiling() or type(args[0]) is not torch.Tensor:
                return op(*args)
            return fn(*args)

        # a function with an attribute, which mypy cannot type otherwise
        eager = cast(_EagerOp, call)
        eager.register_fake = op.register_fake
        return eager

    return wrap


@_op("quack_up_forward")
def _up_forward(
    x: torch.Tensor, rows: torch.Tensor | None, offs: torch.Tensor, w13: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, dim]; rows [R] int32, the row of x each routed row reads (None: x holds the R
    routed rows); offs [E + 1]; w13 [E, 2 * ffn, dim]; p [R] float32 -> ab [R, 2 * ffn] (each
    row's (gate, up) pairs) and h = silu(gate) * up * p [R, ffn], from one GEMM."""
    ab, h = _up_outputs(x, rows, w13)
    if not _no_kernel(x, ab, h):  # else: ab = 0, so h = silu(0) * 0 * p = 0
        _tuned(_up_launch, "gated", (x, w13.mT, ab, h, offs, rows, p), rows)
    return ab, h


def _up_launch(x, w13t, ab, h, offs, rows, p, config=None):
    # config None: QuACK's frontend tunes over its own space at a signature's first call
    up_epilogue()(
        x, w13t, None, out={"D": ab, "postact": h}, cu_seqlens_m=offs, A_idx=rows, p=p, config=config, **_SCHED
    )


# Each GEMM's config is chosen once per call signature. QuACK's autotuner times each config of its
# space once, one after the other, on a card whose clock falls as it nears its power limit during
# the sweep, so configs within a few percent of each other swap ranks from one sweep to the next
# (the `kernels` suite's grouped GEMM tunings, bench/results/kernels_*.json). Its _TOP fastest
# configs are timed again on the call's own operands, in _ROUNDS rounds that each time every one
# in turn, and the least median is kept.
_TOP, _ROUNDS = 4, 3
_CONFIGS: dict[tuple, object] = {}


def _tuned(launch, epilogue: str, args: tuple, rows: torch.Tensor | None):
    """launch(*args, config=...) of a varlen-M GEMM with an epilogue (rows: its gathered rows, or
    None), its config chosen at the signature's first call (_choose, over QuACK's configs for it)."""
    key = (launch, *_signature(*args))
    if key not in _CONFIGS:
        device = args[0].device
        tuner = (
            _tuner(launch, epilogue, rows is not None, torch.cuda.get_device_capability(device)[0])
            if device.type == "cuda"
            else None
        )
        _CONFIGS[key] = None if tuner is None else _choose(tuner, args)
    return launch(*args, config=_CONFIGS[key])


def _choose(tuner, args: tuple, kwargs: dict | None = None):
    """The config tuner.fn(*args, **kwargs, config=...) takes least time with: tuner (QuACK's
    autotuner of that launch) sweeps its space on these operands (or reads QuACK's disk cache of
    an earlier sweep), then its _TOP fastest are timed again in turn (_fastest). Where the tuner
    had this signature already (no sweep now), its pick."""
    kwargs = kwargs or {}
    timings = getattr(tuner, "configs_timings", None)
    tuner(*args, **kwargs)
    if getattr(tuner, "configs_timings", None) is timings:
        return tuner.best_config.kwargs["config"]
    ranked = sorted(tuner.configs_timings.items(), key=lambda item: item[1][0])[:_TOP]
    return _fastest([c.kwargs["config"] for c, _ in ranked], lambda c: tuner.fn(*args, **kwargs, config=c), _time_ms)


def _fastest(candidates: list, run: Callable, time_ms: Callable) -> object:
    """The candidate c whose run(c) has the least median time_ms over _ROUNDS rounds, each round
    timing every candidate in turn (a clock that drifts over the rounds moves them alike)."""
    times: list[list[float]] = [[] for _ in candidates]
    for _ in range(_ROUNDS):
        for c, t in zip(candidates, times, strict=True):
            t.append(time_ms(lambda c=c: run(c)))
    medians = [sorted(t)[len(t) // 2] for t in times]
    return candidates[medians.index(min(medians))]


def _time_ms(fn: Callable, warmup: int = 2, iters: int = 10) -> float:
    """Mean ms of fn's GPU work over iters calls after warmup calls (events on the current stream)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


@functools.cache
def _tuner(launch, epilogue: str, gather_A: bool, cap: int):
    """QuACK's autotuner of launch, a varlen-M GEMM with QuACK's `epilogue` configs, over its
    configs for GPUs of compute capability major `cap`. On sm90 a gathered left operand adds each
    config's 1x1-cluster twin: gathering rules out clusters along N and QuACK's sm90 space has no
    1x1 cluster, so all its configs cover each expert's rows in blocks of two tiles along M, half a
    block empty an expert on average (which wins depends on the rows per expert: bench/results/).
    None for a QuACK without that interface (its frontend tunes)."""
    try:
        from quack.autotuner import AutotuneConfig, Autotuner
        from quack.gemm_config import config_supports, get_all_configs
    except ImportError:
        return None
    space = [
        c
        for c in get_all_configs(epilogue=epilogue)
        if c.device_capacity == cap
        and c.split_k == 1
        and not c.use_tma_gather
        and config_supports(c, gather_A=gather_A, varlen_m=True)
    ]
    if gather_A and cap == 9:
        space += [replace(c, cluster_m=1) for c in space]
    configs = [AutotuneConfig(config=c) for c in dict.fromkeys(space)]
    return Autotuner(launch, key=[], configs=configs, cache_results=True)


def _up_outputs(x, rows, w13):
    R = x.shape[0] if rows is None else rows.shape[0]
    return x.new_empty(R, w13.shape[1]), x.new_empty(R, w13.shape[1] // 2)


@_up_forward.register_fake
def _(x, rows, offs, w13, p):
    return _up_outputs(x, rows, w13)


@_op("quack_up_backward")
def _up_backward(
    dab: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None, offs: torch.Tensor, w13: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> dx_rows [R, dim] (dab @ w13[e]), dw13 [E, 2 * ffn, dim]."""
    q = quack()
    x_rows = x if rows is None else x[rows]  # [R, dim]: the weight gradient contracts over rows
    return _varlen_m(q, dab, w13, offs), _wgrad(q, dab, x_rows, offs)


@_up_backward.register_fake
def _(dab, x, rows, offs, w13):
    return dab.new_empty(dab.shape[0], x.shape[1]), torch.empty_like(w13)


@_op("quack_down_forward")
def _down_forward(h: torch.Tensor, offs: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """h [R, ffn], w2 [E, dim, ffn] -> [R, dim]."""
    return _varlen_m(quack(), h, w2.mT, offs)


@_down_forward.register_fake
def _(h, offs, w2):
    return h.new_empty(h.shape[0], w2.shape[1])


@_op("quack_down_backward")
def _down_backward(
    dy: torch.Tensor, ab: torch.Tensor, p: torch.Tensor, offs: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy [R, dim], ab [R, 2 * ffn], p [R] float32 -> dab [R, 2 * ffn], dw2 [E, dim, ffn], dp [R]:
    with g = dy @ w2[e] (fp32, in the epilogue) dab = SwiGLU's backward of g * p, h = swiglu(ab) * p
    (the forward's h, recomputed) and dp = sum(g * swiglu(ab)) over ffn."""
    q = quack()
    dab, h, dp = _dgated(q, dy, ab, p, offs, w2)
    return dab, _wgrad(q, dy, h, offs), dp


def _dgated(q, dy, ab, p, offs, w2):
    # -> dab, h, dp (see _down_backward): one varlen-M GEMM, the SwiGLU's backward in its epilogue
    return _tuned(_dgated_launch, "gated", (dy, w2, ab, p, offs), None)


def _dgated_launch(dy, w2, ab, p, offs, config=None):
    return quack().gemm_dgated(
        dy, w2, ab, activation="swiglu", colvec_scale=p, colvec_reduce=True, cu_seqlens_m=offs, config=config, **_SCHED
    )


@_down_backward.register_fake
def _(dy, ab, p, offs, w2):
    return torch.empty_like(ab), torch.empty_like(w2), torch.empty_like(p)


def _varlen_m(
    q, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    # [T or R, k], [E, k, n] -> [R, n]: each expert's rows of a (a[rows] when rows is given,
    # gathered by the GEMM) times b[e]
    out = a.new_empty(a.shape[0] if rows is None else rows.shape[0], b.shape[-1])
    return _gemm(q, a, b, out, cu_seqlens_m=offs, a_idx=rows)


def _wgrad(q, left: torch.Tensor, right: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # [R, m], [R, n] -> [E, m, n]: each expert's left rows^T times its right rows (an expert
    # without rows gets zeros: its tiles run no K step and store the zero accumulator)
    out = left.new_empty(offs.shape[0] - 1, left.shape[1], right.shape[1])
    return _gemm(q, left.mT, right, out, cu_seqlens_k=offs)


# QuACK's resolved launch of each call signature: (chosen config, split-K, scheduler, its
# dispatch plan). QuACK's eager gemm replays plain calls so, but takes its general path for every
# varlen or gathered call (all of ours), at about three times a replay's host time (bench/launch.py).
_PLANS: dict[tuple, tuple] = {}


def _signature(*operands: torch.Tensor | None) -> tuple:
    """The key of a launch chosen once per call signature: the first operand's device, then each
    operand's dtype, shape and strides (None where an operand is absent)."""
    assert operands[0] is not None, "the first operand is always given"
    return (operands[0].device, *(t if t is None else (t.dtype, t.shape, t.stride()) for t in operands))


def _no_kernel(a: torch.Tensor, *outs: torch.Tensor) -> bool:
    """Whether the product of a with any operand needs no kernel: its outputs are empty, or the
    contraction is (QuACK's kernels refuse it: a @ b = 0, and the outputs are zeroed)."""
    if not outs[0].numel():
        return True
    if not a.numel():
        for out in outs:
            out.zero_()
        return True
    return False


def _gemm(
    q,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_m: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    a_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = a @ b per group: of rows (cu_seqlens_m; a's rows a[a_idx] where given) or of the
    contraction (cu_seqlens_k). A signature's first call chooses its config (_choose, with QuACK's
    tuner of its gemm) and launches it; later calls replay that launch: the same kernel."""
    if _no_kernel(a, out):
        return out
    groups = dict(cu_seqlens_m=cu_seqlens_m, cu_seqlens_k=cu_seqlens_k, A_idx=a_idx)
    key = _signature(a, b, out, *groups.values())
    plan = _PLANS.get(key)
    if plan is None:
        args, kwargs = (a, b, out, None), {**groups, **_SCHED}
        _PLANS[key] = q.gemm_tuned.fn(*args, **kwargs, config=_choose(q.gemm_tuned, args, kwargs))
        return out
    config, split_k, dynamic, dispatch = plan
    q._gemm_execute(
        a,
        b,
        out,
        None,
        **groups,
        bias=None,
        alpha=1.0,
        beta=1.0,
        batch_idx_permute=None,
        add_to_output=False,
        dynamic_scheduler=dynamic,
        config=config,
        rounding_mode=q.RoundingMode.RN,
        sr_seed=0,
        concat_layout=None,
        SFA=None,
        SFB=None,
        split_k=split_k,
        split_k_mode=q.SplitKMode.SERIAL,
        dispatch_plan=dispatch,
    )
    return out


class _Experts(torch.autograd.Function):
    """y = (silu(gate) * up * p) @ w2[e].T per expert's rows, (gate, up) = x[rows] @ w13[e].T."""

    @staticmethod
    def forward(ctx, x, rows, offs, w13, w2, p, slot, k, row_sum):
        ab, h = _up_forward(x, rows, offs, w13, p)  # [R, 2 * ffn], [R, ffn]
        y = _down_forward(h, offs, w2)  # [R, dim]
        ctx.save_for_backward(x, rows, offs, w13, w2, ab, p, slot)
        ctx.k, ctx.row_sum = k, row_sum
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rows, offs, w13, w2, ab, p, slot = ctx.saved_tensors
        dab, dw2, dp = _down_backward(dy.contiguous(), ab, p, offs, w2)
        dx_rows, dw13 = _up_backward(dab, x, rows, offs, w13)
        dx = dx_rows if rows is None else ctx.row_sum(dx_rows, slot, ctx.k)
        return dx, None, None, dw13, dw2, dp, None, None, None


@_op("quack_dgrad")
def _dgrad(dy: torch.Tensor, offs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dy [R, n], w [E, n, k] -> dy @ w[e] per expert's rows, [R, k]."""
    return _varlen_m(quack(), dy, w, offs)


@_dgrad.register_fake
def _(dy, offs, w):
    return dy.new_empty(dy.shape[0], w.shape[2])


@_op("quack_wgrad")
def weight_grad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dy [R, n], x [R, k] -> [E, n, k]: each expert's dy rows^T times its x rows (varlen-K)."""
    return _wgrad(quack(), dy, x, offs)


@weight_grad.register_fake
def _(dy, x, offs):
    return dy.new_empty(offs.shape[0] - 1, dy.shape[1], x.shape[1])


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [R, k] rows grouped by expert (offs from offsets()), w [E, n, k] -> x @ w[e].T per
    expert's rows, [R, n] (no autograd: moe/wgrad.py's split GEMM)."""
    return _down_forward(x, offs, w)


def grouped_dgrad(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_linear's input gradient: dy [R, n] -> dy @ w[e] per expert's rows, [R, k]."""
    return _dgrad(dy, offs, w)


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """[E] rows per expert (on the device) -> [E + 1] int32: each expert's first row, then R."""
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)


def quack_experts(
    x: torch.Tensor,
    offs: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    probs: torch.Tensor,
    prob_before_w2: bool,
    gather: Gather | None = None,
) -> torch.Tensor:
    """The routed experts' SwiGLU FFN on QuACK's GEMMs: [R, dim], each row times its routing
    weight probs [R] (before w2 or after it).

    x [T, dim] bf16 with gather (rows of x read in place), or the R routed rows themselves;
    offs from offsets(); w13 [E, 2 * ffn, dim] (gate, up rows alternating), w2 [E, dim, ffn]."""
    rows, slot, k, row_sum = (
        (None, None, 1, None)
        if gather is None
        else (gather.rows.to(torch.int32), gather.slot, gather.k, gather.row_sum)
    )
    p = probs.float()
    if prob_before_w2:
        return _Experts.apply(x, rows, offs, w13, w2, p, slot, k, row_sum)
    y = _Experts.apply(x, rows, offs, w13, w2, torch.ones_like(p), slot, k, row_sum)
    return y * p.unsqueeze(-1).to(y.dtype)
