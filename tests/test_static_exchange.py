"""moe.exchange = "static" and "device": the dropless exchanges over ep x etp with the counts on
the device. The static one sends each peer a worst-case block; the device one moves the real
rows into a worst-case receive buffer (moe/exchange.py; here its stand-in, the op's contract
over gloo, which is also sync-free).

On 4 gloo ranks in fp32 (one case float64: the per-expert loop): each gives the exact
dispatcher's output, input gradient and every parameter gradient (router gate, expert
weights), and the one-rank layer's, over ep 2 (edp 2), ep 4 and ep 2 x etp 2;
with every token routed to the first ep rank's experts (each rank's block for that peer full:
the worst case), with the routing weight after w2, with the weight gradients split off
(ep_overlap = "wgrad", static only); the experts' outputs and input gradients on the padding rows
NaN, as undefined as they may be. Forward and backward of the static and device layers make no
host sync (tests/host_sync.py; it sees the layer's code, not inside the device exchange's op);
the same check raises on the exact exchange. Both compile to one
graph each way with static sizes. Paged stashing (moe.stash_rows): the same numbers, the real
rows only, every dtype given back bit for bit, and the trainer's stop when the pool is too small.
The device exchange's NVSHMEM op itself: tests/gpu_device_exchange.py on 2 GPUs.
"""

import copy
from dataclasses import KW_ONLY, dataclass, field
from functools import partial

import pytest
import torch
import torch.distributed as dist
from helpers import DIM, forked, make_layer
from host_sync import HostSync, no_host_sync
from launcher import end_rank_checks, expert_meshes, fork_ranks, run_checks, start_rank

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

WORLD = 4
FFN = 16  # 16-byte aligned rows of each etp shard in fp32: the grouped GEMMs run
B_LOC, S_LOC = 2, 6  # sequences and tokens per sequence on each rank
LAYOUTS = [(2, 1), (4, 1), (2, 2)]  # (ep, etp); edp = 4 / (ep * etp)


@dataclass(frozen=True)
class Case:
    name: str
    _: KW_ONLY
    overrides: dict = field(default_factory=dict)  # MoEArgs overrides
    skew: float = 0.0  # > 0: experts 0 and 1 win every token
    dtype: torch.dtype = torch.float32


CASES = [
    Case("random", overrides=dict(shared_ffn_dim=FFN)),
    Case("all_to_first_rank", skew=3.0),
    Case("top4_prob_after_w2", overrides=dict(top_k=4, prob_before_w2=False)),
    Case("all_to_first_rank_loop", skew=3.0, dtype=torch.float64),
    Case("delay_wgrad", overrides=dict(ep_overlap="wgrad"), skew=3.0),
]


class _NaNGradOn(torch.autograd.Function):
    """Identity whose backward writes NaN into the gradient rows `pad` [R] bool."""

    @staticmethod
    def forward(ctx, x, pad):
        ctx.save_for_backward(pad)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (pad,) = ctx.saved_tensors
        return torch.where(pad.view(-1, *[1] * (grad.dim() - 1)), float("nan"), grad), None


def poison_padding(experts):
    """The experts' contract for rows past their last group, at its worst: NaN outputs and NaN
    input gradients there (torch._grouped_mm leaves them uninitialized, on the CPU often zeros)."""
    compute = experts.forward

    def forward(x, counts, probs, *args, **kwargs):
        pad = torch.arange(x.shape[0]) >= counts.sum()  # [R]
        y = compute(_NaNGradOn.apply(x, pad), counts, _NaNGradOn.apply(probs, pad), *args, **kwargs)
        return torch.where(pad[:, None], float("nan"), y)

    experts.forward = forward


def watch_exchange(dispatcher) -> list:
    """-> the list that will hold what crosses the ep all-to-alls around the experts: their
    output rows and the gradients of their input rows and weights."""
    seen, compute = [], dispatcher.compute

    def watched(x_in, w_in, *args):
        for t in (x_in, w_in):
            t.register_hook(seen.append)
        y_in = compute(x_in, w_in, *args)
        seen.append(y_in.detach())
        return y_in

    dispatcher.compute = watched
    return seen


def step(moe, x, upstream):
    """-> (y, x.grad, {parameter name: grad}) of one forward and backward."""
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * upstream).sum().backward()
    if moe.experts.wgrad is not None:
        moe.experts.wgrad.flush()
    return y.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters()}


def check_case(case: Case, ep_mesh, etp_mesh, mode="static"):
    from titan_fold.moe import MoEArgs
    from titan_fold.parallel.experts import expert_slice, shard_moe

    name, overrides, skew, dtype = case.name, case.overrides, case.skew, case.dtype
    args = MoEArgs(**{"num_experts": 8, "top_k": 2, "moe_ffn_dim": FFN, "load_balance": "none", **overrides})
    one_rank = make_layer(args, dtype, seed=len(name), skew=skew)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(B_LOC, S_LOC, DIM, generator=g, dtype=torch.float64)
    x = (x.abs() + 0.5 if skew else x).to(dtype)
    upstream = torch.randn(B_LOC, S_LOC, DIM, generator=g, dtype=torch.float64).to(dtype)
    runs = {}
    exchanged = None
    for run in ("exact", mode):
        moe = copy.deepcopy(one_rank)
        moe.args.exchange = run
        shard_moe(moe, ep_mesh, etp_mesh)
        if run == mode:
            poison_padding(moe.experts)
            if mode == "static":
                exchanged = watch_exchange(moe.dispatcher)
        runs[run] = step(moe, x, upstream)
    ref = step(one_rank, x, upstream)

    (y, xg, grads), (y_ex, xg_ex, grads_ex) = runs[mode], runs["exact"]
    name = f"{mode} {name}"
    # parameter gradients in full shapes, summed over the world: every token's contribution
    full = {}
    for key, grad in grads.items():
        if key.startswith("experts."):
            full[key] = torch.zeros_like(ref[2][key])
            expert_slice(full[key], key.rsplit(".", 1)[1], ep_mesh, etp_mesh).copy_(grad)
        else:
            full[key] = grad
    both = torch.cat([t.flatten() for t in full.values()] + [ref[2][k].flatten() for k in full])
    dist.all_reduce(both)
    half = both.numel() // 2

    # all collectives done: now compare
    def close(got, want, what, vs_one_rank=False):
        if dtype == torch.float64:
            tol = dict(rtol=1e-10, atol=1e-12)
        else:  # the one-rank layer sums in another order; the exact exchange in the same
            tol = dict(rtol=1e-4, atol=1e-5) if vs_one_rank else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {what}\n{m}")

    ep = 1 if ep_mesh is None else ep_mesh.size()
    if skew:  # every assignment goes to the first ep rank's experts: its block from each rank is full
        experts_idx = one_rank.router(x.flatten(0, 1), S_LOC).experts
        assert (experts_idx < args.num_experts // ep).all(), "the skewed case does not reach the worst case"
    if exchanged is not None:
        assert len(exchanged) == 3 and all(t.isfinite().all() for t in exchanged), (
            f"{name}: the experts' NaN padding rows reached the exchange"
        )
    close(y, y_ex, "output, static vs exact")
    close(xg, xg_ex, "input grad, static vs exact")
    for key in grads:
        close(grads[key], grads_ex[key], f"grad of {key}, static vs exact")
    close(y, ref[0], "output, static vs one rank", True)
    close(xg, ref[1], "input grad, static vs one rank", True)
    close(both[:half], both[half:], "parameter grads, static vs one rank", True)


def check_no_host_sync(ep_mesh, etp_mesh, mode="static"):
    """Forward and backward of the whole static or device layer (shared expert, aux loss, the
    stash with static) read nothing on the host; the exact exchange does (its split sizes)."""
    from titan_fold.moe import MoEArgs, TokenDispatcher
    from titan_fold.moe.stash import Stash
    from titan_fold.parallel.experts import shard_moe

    args = MoEArgs(
        num_experts=8,
        top_k=2,
        moe_ffn_dim=FFN,
        shared_ffn_dim=FFN,
        load_balance="aux_loss",
        z_loss_coeff=1e-3,
        exchange=mode,
    )
    moe = make_layer(args, torch.float32)
    shard_moe(moe, ep_mesh, etp_mesh)
    if mode == "static":
        moe.dispatcher.stash = Stash(rows=10_000)
    x = torch.randn(B_LOC, S_LOC, DIM, requires_grad=True)
    with no_host_sync():
        moe(x).square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in moe.parameters())
    assert mode != "static" or moe.dispatcher.stash.pools, "nothing was stashed"
    moe.args.exchange = "exact"
    moe.dispatcher = TokenDispatcher(moe.args, ep_mesh, etp_mesh)  # the exchange is chosen when it is built
    try:
        with no_host_sync():
            moe(x)
    except HostSync as e:
        assert "tolist" in str(e), e
    else:
        raise AssertionError("the exact exchange passed the host-sync check")


def check_compiles_static(ep_mesh, etp_mesh, mode="static"):
    """torch.compile(fullgraph=True) traces the static (or device) layer, bf16, forward and backward, as one
    graph each way with no size read from the device (no unbacked symbol), and new data
    compiles nothing new: what compile.cudagraphs records once and replays."""
    from torch._dynamo.backends.common import aot_autograd
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from titan_fold.moe import MoEArgs
    from titan_fold.parallel.experts import shard_moe

    graphs = []

    def check(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            assert not (isinstance(value, torch.Tensor) and free_unbacked_symbols(value)), (
                f"{node.format_node()}: a size read from the device"
            )
        graphs.append(gm)
        return gm

    args = MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=FFN, shared_ffn_dim=FFN, exchange=mode)
    moe = make_layer(args, torch.bfloat16)
    shard_moe(moe, ep_mesh, etp_mesh)
    torch._dynamo.reset()
    compiled = torch.compile(moe, backend=aot_autograd(fw_compiler=check, bw_compiler=check), fullgraph=True)
    for i in range(2):
        x = (torch.randn(B_LOC, S_LOC, DIM) * (i + 1)).bfloat16().requires_grad_()
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled(x).float().square().sum().backward()
        torch.testing.assert_close(x.grad, torch.autograd.grad(moe(x).float().square().sum(), x)[0])
    assert len(graphs) == 2, f"{len(graphs)} graphs: one forward and one backward expected"


def check_stash(ep_mesh):
    """moe.stash_rows, ep 2, every token routed to the first rank's experts: two layer calls in
    flight (one layer run twice before backward) give the same outputs and gradients as without
    the stash, with the pools' rows past the real ones poisoned with NaN after forward, eager and
    under torch.compile; the pool holds exactly the real rows the rank's experts got (V1 + V2,
    not twice the worst case), and is free again after backward. One row fewer: the guard's
    check before the optimizer step stops every rank with a line naming moe.stash_rows."""
    from titan_fold.moe import MoEArgs
    from titan_fold.moe.stash import Stash
    from titan_fold.parallel.experts import shard_moe
    from titan_fold.trainer.guard import NonFiniteGuard, StashOverflow

    args = MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=FFN, load_balance="none", exchange="static")
    layer = make_layer(args, torch.float32, skew=3.0)
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(B_LOC, S_LOC, DIM, generator=g).abs() + 0.5 for _ in range(2)]
    # the real rows each ep rank's experts get in the two calls: every rank's assignments to them
    ep, E_loc = ep_mesh.size(), args.num_experts // ep_mesh.size()
    sent = sum(
        torch.bincount(layer.router(x.flatten(0, 1), S_LOC).experts.flatten() // E_loc, minlength=ep) for x in xs
    )
    dist.all_reduce(sent, group=ep_mesh.get_group())
    real = int(sent[ep_mesh.get_local_rank()])
    most = sent.max().clone()  # the pool rows the config must give: the most any rank needs
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    most = int(most)

    def run(stash, compiled=False):
        moe = copy.deepcopy(layer)
        shard_moe(moe, ep_mesh)
        moe.dispatcher.stash = stash
        call = moe
        if compiled:
            torch._dynamo.reset()
            call = torch.compile(moe, backend="aot_eager")
        inputs = [x.clone().requires_grad_() for x in xs]
        ys = [call(x) for x in inputs]
        held = None
        if stash is not None:
            held = (int(stash.offset), stash.outstanding)
            for pool in stash.pools:  # what later layers would write past the real rows
                pool[int(stash.offset) :] = float("nan") if pool.is_floating_point() else 0
        sum((y * y.detach().roll(1, -1)).sum() for y in ys).backward()
        grads = [x.grad for x in inputs] + [p.grad for p in moe.parameters()]
        return [y.detach() for y in ys] + grads, held

    want, _ = run(None)
    stash = Stash(rows=most)
    got, held = run(stash)
    compiled_stash = Stash(rows=most)
    got_compiled, held_compiled = run(compiled_stash, compiled=True)
    small = Stash(rows=most - 1)
    run(small)
    guard = NonFiniteGuard("stop", torch.device("cpu"))
    guard.stashes, guard.stash_rows = [small], small.rows
    try:
        guard.before_optimizer_step()
    except StashOverflow as e:
        overflow = str(e)
    else:
        overflow = None

    # all collectives done: now compare
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"stash on vs off\n{m}")
    for a, b in zip(got_compiled, want, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m: f"compiled, stash on vs eager, off\n{m}")
    assert held[0] == real and held[1] > 0, f"pool rows in use, stashed tensors {held}; real rows {real}"
    assert held_compiled == held, f"compiled: pool rows in use, stashed tensors {held_compiled}; eager {held}"
    for s in (stash, compiled_stash):
        assert (s.outstanding, int(s.offset)) == (0, 0), "the pool is not free after backward"
    worst = ep * B_LOC * S_LOC * args.top_k  # one layer call's received rows R: the tail room
    assert stash.pools and all(p.shape[0] == most + worst for p in stash.pools), [p.shape for p in stash.pools]
    assert overflow is not None and f"moe.stash_rows = {most - 1}:" in overflow and f"needed {most} rows" in overflow, (
        overflow
    )
    assert most == 2 * worst, "the skewed case does not send every row to one rank"


def worker(rank, port, out_dir):
    start_rank(rank, port, WORLD)
    failures = []
    for ep, etp, _, ep_mesh, etp_mesh in expert_meshes(LAYOUTS, WORLD):
        checks = [(c.name, partial(check_case, c, ep_mesh, etp_mesh)) for c in CASES]
        checks += [
            (f"device {c.name}", partial(check_case, c, ep_mesh, etp_mesh, "device"))
            for c in CASES
            if "ep_overlap" not in c.overrides
        ]
        checks.append(("no host sync", partial(check_no_host_sync, ep_mesh, etp_mesh)))
        checks.append(("device: no host sync", partial(check_no_host_sync, ep_mesh, etp_mesh, "device")))
        if (ep, etp) == (2, 1):
            checks.append(("compiles static", partial(check_compiles_static, ep_mesh, etp_mesh)))
            checks.append(("compiles device", partial(check_compiles_static, ep_mesh, etp_mesh, "device")))
            checks.append(("stash", partial(check_stash, ep_mesh)))
        failures += run_checks(checks, f"ep={ep} etp={etp}")
    end_rank_checks(out_dir, rank, failures)


def test_static_exchange_matches_exact_and_one_rank(tmp_path):
    failures = fork_ranks(worker, WORLD, tmp_path)
    assert not failures, "\n".join(failures)[:20000]


class _Saves(torch.autograd.Function):
    """x -> x, saving t for backward, where it is handed to `seen`."""

    @staticmethod
    def forward(ctx, x, t, seen):
        ctx.save_for_backward(t)
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(ctx.saved_tensors[0])
        return grad, None, None


def test_stash_gives_back_the_real_rows_of_every_dtype():
    """A stashed tensor comes back with its dtype and shape, its V real rows as saved and the
    rest zero, also after a second layer's stash has written over its padding; FP8 and bool
    rows travel as bytes."""
    from titan_fold.moe.stash import Stash

    R, V = 6, torch.tensor(4)
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool):
        stash = Stash(rows=10)
        x = torch.randn(R, 3, requires_grad=True)
        saved = [torch.randn(R, 3).to(dtype), (torch.randn(R) + 2).to(dtype)]
        seen = []
        with stash.layer(V, R):
            y = _Saves.apply(_Saves.apply(x, saved[0], seen), saved[1], seen)
        with stash.layer(V, R):  # a second layer: its rows start at the first one's V
            z = _Saves.apply(x, torch.ones(R, 3).to(dtype), [])
        assert int(stash.offset) == 8 and stash.outstanding == 3
        (y.sum() + z.sum()).backward()
        for got, want in zip(seen[::-1], saved, strict=True):
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got[:4].view(torch.uint8), want[:4].view(torch.uint8)), dtype  # bit for bit
            assert not got[4:].view(torch.uint8).any(), dtype
        assert (stash.outstanding, int(stash.offset)) == (0, 0)
        assert [tuple(p.shape) for p in stash.pools] == [(16, 3), (16,)]  # 10 rows + R


def test_trainer_stops_when_the_stash_overflows(tmp_path):
    """The trainer on 2 gloo ranks at ep 2: its MoE layers share a stash whose overflow the
    NaN/Inf guard reads before the optimizer step: too few rows stop every rank at step 1 with
    one line naming moe.stash_rows and the rows needed; no step is logged."""
    folder = tmp_path / "run"
    codes, _, stderr = forked(
        2,
        "titan_fold.train",
        "--job.config_file",
        "debug_moe.toml",
        "--job.dump_folder",
        str(folder),
        "--training.local_batch_size",
        "1",
        "--training.seq_len",
        "32",
        "--training.steps",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--moe.exchange",
        "static",
        "--moe.stash_rows",
        "8",
    )
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert codes == [2, 2] and len(lines) == 1, stderr[-4000:]
    assert lines[0].startswith("error: moe.stash_rows = 8: the MoE layers in flight at step 1 needed "), lines[0]
    assert not (folder / "metrics.jsonl").exists() or not (folder / "metrics.jsonl").read_text().strip()
