"""EP x ETP dispatcher on 8 gloo ranks against the float64 per-token reference.

One launch runs every case (importing torch on 8 ranks is most of the cost). Each rank
holds its own tokens. The reference is per token, so the reference over all tokens is
the union of per-rank references: each rank checks its own rows, and the weight
gradients (sums over tokens) are summed over the world on both sides. Full-sequence
dropping couples the ranks of one sequence group: there every rank of the group runs the
reference on the group's whole sequences and keeps its slice.
"""

import traceback
from dataclasses import KW_ONLY, dataclass

import pytest
import torch
import torch.distributed as dist
from helpers import DIM, make_layer, reference_moe
from launcher import end_rank_checks, fork_ranks, free_port, rank_failures, start_rank
from outcomes.failures import is_test_assertion

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

WORLD = 8
B, S_LOC = 2, 6  # sequences per rank, tokens of each sequence on this rank
FFN = 16  # divisible by etp 4, 16-byte aligned shards in fp32

LAYOUTS = [(4, 1), (2, 2), (1, 4), (4, 2)]  # (ep, etp); edp = 8 / (ep * etp)


@dataclass(frozen=True)
class Case:
    id: str
    _: KW_ONLY
    top_k: int
    num_experts: int = 8
    capacity_factor: float | None = None  # None: dropless
    drop_policy: str = "probs"
    skew: float = 0.0
    pad: bool = False
    seq_n: int = 1  # > 1: full-sequence dropping over groups of seq_n consecutive ranks
    dtype: torch.dtype = torch.float64
    prob_before_w2: bool = True


CASES = [
    Case("top1_dropless_skew", top_k=1, skew=0.3),
    Case("top2_dropless_prob_after_w2", top_k=2, prob_before_w2=False),
    Case("top8_of_16_dropless_skew", top_k=8, num_experts=16, skew=0.3),
    Case("top2_dropless_fp32", top_k=2, skew=0.3, dtype=torch.float32),
    Case("top2_drop", top_k=2, capacity_factor=1.0),
    Case(
        "top1_drop_position_fp32", top_k=1, capacity_factor=1.25, drop_policy="position", skew=0.3, dtype=torch.float32
    ),
    Case("top2_drop_padded", top_k=2, capacity_factor=1.0, skew=0.3, pad=True),
    Case(
        "top8_of_16_drop_position_padded_prob_after_w2",
        top_k=8,
        num_experts=16,
        capacity_factor=0.5,
        drop_policy="position",
        skew=0.3,
        pad=True,
        prob_before_w2=False,
    ),
    Case("top2_drop_full_sequence_2", top_k=2, capacity_factor=1.0, skew=0.3, seq_n=2),
    Case(
        "top2_drop_position_padded_full_sequence_4",
        top_k=2,
        capacity_factor=0.75,
        drop_policy="position",
        pad=True,
        seq_n=4,
    ),
]


def run_case(case_id, case, ep_mesh, etp_mesh, seq_meshes, weights_mesh, device):
    from titan_fold.common.tensors import local
    from titan_fold.moe import MoEArgs
    from titan_fold.parallel.experts import expert_slice, shard_moe

    top_k, n, dtype, cf = case.top_k, case.seq_n, case.dtype, case.capacity_factor
    rank = dist.get_rank()
    args = MoEArgs(
        num_experts=case.num_experts,
        top_k=top_k,
        moe_ffn_dim=FFN,
        capacity_factor=cf,
        drop_policy=case.drop_policy,
        token_drop="dropless" if cf is None else "drop_and_pad" if case.pad else "drop",
        drop_scope="full_sequence" if n > 1 else "sub_sequence",
        load_balance="none",
        prob_before_w2=case.prob_before_w2,
    )

    # the sequences of this rank's group, [B, n * S_LOC, DIM]; this rank holds chunk i of each
    group, i = rank // n, rank % n
    gen = torch.Generator().manual_seed(1000 * case_id + group)
    X = torch.randn(B, n * S_LOC, DIM, generator=gen, dtype=torch.float64)
    X = X.abs() + 0.5 if case.skew else X
    U = torch.randn(B, n * S_LOC, DIM, generator=gen, dtype=torch.float64)  # upstream gradient
    mine = slice(i * S_LOC, (i + 1) * S_LOC)

    moe = make_layer(args, dtype, seed=case_id, skew=case.skew)
    full = {k: v.detach().double().clone().requires_grad_() for k, v in moe.named_parameters()}
    moe.to(device)
    # odd cases: expert weights as DTensors on the (ep, etp) mesh, even: plain local slices
    shard_moe(moe, ep_mesh, etp_mesh, seq_meshes.get(n), weights_mesh=weights_mesh if case_id % 2 else None)

    x = X[:, mine].to(device, dtype).clone().requires_grad_()
    y = moe(x)
    (y * U[:, mine].to(device, dtype)).sum().backward()
    y, x_grad = y.detach().cpu(), x.grad.cpu()
    with torch.no_grad():
        routing = moe.router(x.flatten(0, 1), S_LOC)
        keep, _ = moe.dispatcher.keep_mask(routing.probs, routing.experts, B, args)
        keep = None if keep is None else keep.cpu()

    # layer gradients in full shapes, summed over the world
    grads = {"router.gate.weight": moe.router.gate.weight.grad.double().cpu()}
    for name in ("w13", "w2"):
        g = torch.zeros_like(full[f"experts.{name}"])
        expert_slice(g, name, ep_mesh, etp_mesh).copy_(local(getattr(moe.experts, name).grad))
        grads[f"experts.{name}"] = g

    # reference on the group's whole sequences (n = 1: this rank's tokens)
    Xr = X.flatten(0, 1).clone().requires_grad_()
    y_ref, kept, _ = reference_moe(Xr, full["router.gate.weight"], full["experts.w13"], full["experts.w2"], args)
    (y_ref * U.flatten(0, 1)).sum().backward()
    ref_grads = {k: full[k].grad / n for k in grads}  # n ranks of the group each ran it

    flat = torch.cat([g.flatten() for g in grads.values()] + [g.flatten() for g in ref_grads.values()])
    flat = flat.to(device)
    dist.all_reduce(flat)
    flat = flat.cpu()
    half = flat.numel() // 2

    # all collectives done: now compare
    rows = (torch.arange(B)[:, None] * n * S_LOC + i * S_LOC + torch.arange(S_LOC)[None]).flatten()
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y.double().flatten(0, 1), y_ref.detach()[rows], **tol, msg="output")
    torch.testing.assert_close(x_grad.double().flatten(0, 1), Xr.grad[rows], **tol, msg="input grad")
    torch.testing.assert_close(flat[:half], flat[half:], **tol, msg="router / expert weight grads")
    if cf is not None:
        kept_ref = torch.tensor([[(int(r), j) in kept for j in range(top_k)] for r in rows])
        assert torch.equal(keep, kept_ref), "drop decision differs from the single-rank reference"
        assert len(kept) < B * n * S_LOC * top_k, "the case drops nothing"


def check_dtensor_init(ep_mesh, etp_mesh, weights_mesh):
    """Expert weights placed as DTensors initialize to the one-rank values."""
    from titan_fold.moe import MoE, MoEArgs
    from titan_fold.parallel.experts import shard_moe

    args = MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=FFN)
    with torch.device("meta"):
        moe = MoE(DIM, args)
    shard_moe(moe, ep_mesh, etp_mesh, weights_mesh=weights_mesh)
    moe.to_empty(device=weights_mesh.device_type)
    torch.manual_seed(3)
    moe.init_weights(0.1)
    full = {n: getattr(moe.experts, n).full_tensor() for n in ("w13", "w2")}
    # one rank on the same device type: CPU and CUDA generators draw different numbers
    with torch.device(weights_mesh.device_type):
        ref = MoE(DIM, args)
    torch.manual_seed(3)
    ref.init_weights(0.1)
    for n, w in full.items():
        assert torch.equal(w, getattr(ref.experts, n).detach()), f"DTensor init of {n} depends on the layout"


def check_shared_expert_overlap(ep_mesh, etp_mesh, device):
    """The shared expert runs after the tokens' all-to-all is issued and before the routed
    experts read them (functional collectives wait at first use); with the overlap off it
    runs first. Both give the same output."""
    import titan_fold.moe.dispatcher as dispatcher_mod
    from titan_fold.moe import MoE, MoEArgs
    from titan_fold.parallel.experts import shard_moe

    args = MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=FFN, shared_ffn_dim=FFN, shared_expert_gate=True)
    torch.manual_seed(0)
    moe = MoE(DIM, args)
    moe.init_weights(0.1)
    moe.to(device)
    shard_moe(moe, ep_mesh, etp_mesh)
    x = torch.randn(2, S_LOC, DIM, device=device)
    events, a2a = [], dispatcher_mod._a2a

    def recorded_a2a(*a, **kw):
        events.append("all_to_all")
        return a2a(*a, **kw)

    moe.experts.register_forward_pre_hook(lambda *_: events.append("experts"))
    moe.shared_expert.register_forward_pre_hook(lambda *_: events.append("shared"))
    dispatcher_mod._a2a = recorded_a2a
    outputs, orders = [], []
    try:
        for overlap in (True, False):
            moe.args.shared_expert_overlap = overlap
            events.clear()
            outputs.append(moe(x))
            orders.append(list(events))
    finally:
        dispatcher_mod._a2a = a2a
    # tokens and weights out, shared expert, routed experts, results back
    assert orders[0] == ["all_to_all", "all_to_all", "shared", "experts", "all_to_all"], orders[0]
    assert orders[1] == ["shared", "all_to_all", "all_to_all", "experts", "all_to_all"], orders[1]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def worker(rank, port, out_dir, world=WORLD, layouts=LAYOUTS, device_type="cpu"):
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    start_rank(rank, port, world, "nccl" if device_type == "cuda" else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device_type, rank if device_type == "cuda" else None)
    failures = []
    seq_meshes = {
        n: init_device_mesh(device_type, (world // n, n), mesh_dim_names=("dp", "seq"))["seq"]
        for n in (2, 4)
        if world % n == 0
    }
    for ep, etp in layouts:
        mesh = init_device_mesh(device_type, (world // (ep * etp), ep, etp), mesh_dim_names=("edp", "ep", "etp"))
        ep_mesh = mesh["ep"] if ep > 1 else None
        etp_mesh = mesh["etp"] if etp > 1 else None
        try:
            check_dtensor_init(ep_mesh, etp_mesh, mesh["ep", "etp"])
            if ep * etp > 1:  # one rank has no exchange to overlap
                check_shared_expert_overlap(ep_mesh, etp_mesh, device)
        except AssertionError as e:
            if not is_test_assertion(e):  # an invariant of titan_fold's: a crash
                raise
            failures.append(f"ep={ep} etp={etp}:\n{traceback.format_exc()}")
        for case_id, case in enumerate(CASES):
            if case.seq_n not in seq_meshes and case.seq_n > 1:
                continue
            try:
                run_case(case_id, case, ep_mesh, etp_mesh, seq_meshes, mesh["ep", "etp"], device)
            except AssertionError as e:
                if not is_test_assertion(e):
                    raise
                failures.append(f"ep={ep} etp={etp} case {case.id}:\n{traceback.format_exc()}")
    end_rank_checks(out_dir, rank, failures)


def launch(out_dir, world=WORLD, layouts=LAYOUTS, device_type="cpu"):
    if device_type == "cuda":  # fresh interpreters: a forked child can use CUDA only if no ancestor did
        import torch.multiprocessing as mp

        mp.start_processes(
            worker, args=(free_port(), str(out_dir), world, layouts, device_type), nprocs=world, start_method="spawn"
        )
        return rank_failures(str(out_dir), world)
    return fork_ranks(worker, world, out_dir, world, layouts, device_type)


def test_dispatcher_matches_reference(tmp_path):
    failures = launch(tmp_path)
    assert not failures, "\n".join(failures)[:20000]


if __name__ == "__main__":
    # on GPUs (NCCL), titan_fold installed: python tests/test_dispatcher.py OUT_DIR
    import sys

    n = torch.cuda.device_count()
    layouts = [(ep, n // ep) for ep in (n, 2, 1) if ep <= n and n % ep == 0]
    failures = launch(sys.argv[1], n, sorted(set(layouts)), "cuda")
    print("\n".join(failures) if failures else f"dispatcher on {n} GPUs: all cases match the reference")
    sys.exit(1 if failures else 0)
