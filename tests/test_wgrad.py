"""The experts' weight gradients apart from their input gradients (moe.ep_overlap = "wgrad").

On 4 gloo ranks in fp32: an MoE layer with the split gives the same output, input gradient
and every parameter gradient as the same layer without it, over ep 2 (edp 2), ep 4 and
ep 2 x etp 2; with token dropping and padding, with the layer recomputed in backward
(activation checkpointing), with FSDP2 over edp, and over two accumulated micro-batches.
The queue really holds the weight gradients: left unflushed, they are missing.
"""

from dataclasses import KW_ONLY, dataclass, field
from functools import partial

import pytest
import torch
import torch.distributed as dist
from helpers import DIM, make_layer
from launcher import end_rank_checks, expert_meshes, fork_ranks, run_checks, start_rank

WORLD = 4
FFN = 16  # 16-byte aligned rows of each etp shard in fp32: the grouped GEMMs run
LAYOUTS = [(2, 1), (4, 1), (2, 2)]  # (ep, etp); edp = 4 / (ep * etp)


@dataclass(frozen=True)
class Case:
    name: str
    _: KW_ONLY
    layer_args: dict = field(default_factory=dict)  # MoEArgs overrides
    recompute: bool = False
    fsdp: bool = False  # FSDP2 over edp
    microbatches: int = 1


CASES = [
    Case("dropless"),
    Case("drop_padded", layer_args=dict(token_drop="drop_and_pad", capacity_factor=1.0)),
    Case("shared_expert_prob_after_w2", layer_args=dict(shared_ffn_dim=FFN, prob_before_w2=False)),
    Case("recompute", recompute=True),
    Case("fsdp_edp", fsdp=True),
    Case("two_microbatches", layer_args=dict(top_k=1), microbatches=2),
]


def run(layer_args, delay, mesh, ep_mesh, etp_mesh, recompute, fsdp, microbatches, flush=True):
    """-> (outputs, input grads, {param name: full grad}) of one rank."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from titan_fold.moe import MoEArgs
    from titan_fold.moe.wgrad import flush_wgrad
    from titan_fold.parallel.experts import shard_moe

    args = MoEArgs(
        **{"num_experts": 8, "top_k": 2, "moe_ffn_dim": FFN, "ep_overlap": "wgrad" if delay else "off", **layer_args}
    )
    moe = make_layer(args, torch.float32)
    weights_mesh = mesh["ep", "etp"] if etp_mesh is not None else mesh["ep"]
    shard_moe(moe, ep_mesh, etp_mesh, weights_mesh=weights_mesh)
    if fsdp:
        fully_shard(moe.experts, mesh=mesh["edp"], shard_placement_fn=lambda p: Shard(2 if p.shape[2] == DIM else 1))
        moe.experts.set_gradient_divide_factor(1.0)
        moe.experts.set_force_sum_reduction_for_comms(True)
    layer = checkpoint_wrapper(moe, preserve_rng_state=False) if recompute else moe
    if not flush:
        moe.experts.wgrad.flush_in_dispatch = False
    outs, x_grads = [], []
    for mb in range(microbatches):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + mb)
        x = torch.randn(2, 6, DIM, generator=g).requires_grad_()
        y = layer(x)
        (y * torch.randn(y.shape, generator=g)).sum().backward()
        outs.append(y.detach())
        x_grads.append(x.grad)
    if not flush:
        pending = len(moe.experts.wgrad)
        missing = [n for n, p in moe.experts.named_parameters() if p.grad is not None]
        flush_wgrad(moe)
        assert pending == 2 * microbatches, f"{pending} weight gradients queued, expected 2 per micro-batch (w13, w2)"
        assert not missing, f"weight gradients present before the flush: {missing}"
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in moe.named_parameters()}
    return torch.cat(outs), torch.cat(x_grads), grads


def check_case(case: Case, mesh, ep_mesh, etp_mesh):
    name = case.name
    ref = run(case.layer_args, False, mesh, ep_mesh, etp_mesh, case.recompute, case.fsdp, case.microbatches)
    got = run(case.layer_args, True, mesh, ep_mesh, etp_mesh, case.recompute, case.fsdp, case.microbatches)
    tol = dict(rtol=1e-5, atol=1e-6)  # fp32: the padded path sums in another order (bmm)
    torch.testing.assert_close(got[0], ref[0], **tol, msg=f"{name}: output")
    torch.testing.assert_close(got[1], ref[1], **tol, msg=f"{name}: input grad")
    assert got[2].keys() == ref[2].keys()
    for key in ref[2]:
        assert ref[2][key] is not None, (name, key)
        torch.testing.assert_close(
            got[2][key], ref[2][key], **tol, msg=lambda m, key=key: f"{name}: grad of {key}: {m}"
        )


def check_order(mesh, ep_mesh, etp_mesh):
    """In backward the weight gradients run after the dispatch all-to-all's reverse is issued
    and before it is waited for."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run({}, True, mesh, ep_mesh, etp_mesh, False, False, 1)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    names = [e.name for e in events]
    w = names.index("moe:experts weight gradients")
    issued = [n for n in names[:w] if "all_to_all_single" in n or "wait_tensor" in n]
    assert issued and "all_to_all_single" in issued[-1], issued[-3:]  # issued, not yet waited for
    after = [e.name for e in events[w + 1 :] if e.time_range.start >= events[w].time_range.end]
    assert any("wait_tensor" in n for n in after), "the all-to-all was waited for before the weight gradients"


def check_unflushed(mesh, ep_mesh, etp_mesh):
    ref = run({}, False, mesh, ep_mesh, etp_mesh, False, False, 2)
    got = run({}, True, mesh, ep_mesh, etp_mesh, False, False, 2, flush=False)
    for key in ref[2]:
        torch.testing.assert_close(got[2][key], ref[2][key], rtol=1e-5, atol=1e-6, msg=f"deferred: grad of {key}")


def worker(rank, port, out_dir):
    start_rank(rank, port, WORLD)
    failures = []
    for ep, etp, mesh, ep_mesh, etp_mesh in expert_meshes(LAYOUTS, WORLD):
        checks = [
            (c.name, partial(check_case, c, mesh, ep_mesh, etp_mesh))
            for c in CASES
            if not (c.fsdp and WORLD // (ep * etp) == 1)
        ]
        checks.append(("unflushed", partial(check_unflushed, mesh, ep_mesh, etp_mesh)))
        checks.append(("order", partial(check_order, mesh, ep_mesh, etp_mesh)))
        failures += run_checks(checks, f"ep={ep} etp={etp}")
    end_rank_checks(out_dir, rank, failures)


def test_delayed_wgrad_matches(tmp_path):
    failures = fork_ranks(worker, WORLD, tmp_path)
    assert not failures, "\n".join(failures)[:20000]


@pytest.mark.parametrize("fp8, counts", [(False, [5, 0, 7, 4]), (True, [5, 0, 7, 4]), (False, 4)])
def test_experts_split_equals_joint_backward(fp8, counts):
    """One rank: GroupedExperts with its weight gradients queued (bf16 grouped GEMM path, the
    FP8 path's CPU emulation, padded groups) equals the joint backward once flushed."""
    from titan_fold.moe.experts import GroupedExperts
    from titan_fold.moe.wgrad import WgradQueue

    torch.manual_seed(0)
    dtype = torch.float32
    rows = sum(counts) if isinstance(counts, list) else 4 * counts
    x0, p0, g = torch.randn(rows, 32), torch.rand(rows), torch.randn(rows, 32)
    results = []
    for split in (False, True):
        experts = GroupedExperts(32, 16, 4, "fp8" if fp8 else "auto")
        torch.manual_seed(1)
        experts.init_weights(0.1)
        experts.wgrad = WgradQueue() if split else None
        x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        c = torch.tensor(counts) if isinstance(counts, list) else counts
        experts(x.to(dtype), c, p, True).backward(g)
        if split:
            assert len(experts.wgrad) == 2 and all(w.grad is None for w in experts.parameters())
            experts.wgrad.flush()
        results.append((x.grad, p.grad, *(w.grad for w in experts.parameters())))
    for ref, got in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
