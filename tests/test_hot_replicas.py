"""moe.hot_expert_replicas: the planner against an exhaustive oracle, and the MoE layer with
copies of hot experts against the float64 per-token reference on 4 gloo ranks (ep4, ep2 x etp2,
and ep2 x edp2 compiled), under a forced skew and with every token sent to one expert.
The trainer's runs: tests/test_hot_replicas_train.py."""

import itertools
import traceback

import pytest
import torch
import torch.distributed as dist
from helpers import DIM, make_layer, reference_moe
from launcher import end_rank_checks, fork_ranks, start_rank
from outcomes.failures import is_test_assertion

from titan_fold.moe.replicas import nominate, oracle_max_load, physical_experts, water_fill


@pytest.mark.parametrize("ep,R", [(2, 1), (3, 1), (2, 2), (4, 1), (3, 2)])
def test_planner_matches_oracle(ep, R):
    """From the counts of several sources, the rows each rank runs: its largest load is the
    oracle's (the best over every split of the nominees' rows), every assignment runs once,
    on its expert's home or on a copy of it, and the nominees are the busiest experts."""
    gen = torch.Generator().manual_seed(ep * 10 + R)
    E_loc, S = 2, 3
    for _ in range(8):
        counts = torch.randint(0, 4, (S, ep * E_loc), generator=gen)
        counts[:, int(torch.randint(0, ep * E_loc, (1,), generator=gen))] += 4  # a hot expert
        totals = counts.sum(0)
        per_rank = torch.zeros(ep, dtype=torch.int64)
        for me in range(S):
            idx = torch.repeat_interleave(torch.arange(ep * E_loc), counts[me])
            idx = idx[torch.randperm(idx.numel(), generator=gen)][:, None]  # in any order
            physical, nominees = physical_experts(idx, counts, me, ep, R)
            P_loc = E_loc + R
            per_rank += torch.bincount(physical.flatten() // P_loc, minlength=ep)
            logical, slot = idx.flatten(), physical.flatten() % P_loc
            is_home = slot < E_loc
            assert torch.equal(physical.flatten()[is_home], (logical // E_loc * P_loc + logical % E_loc)[is_home])
            assert torch.equal(nominees[slot[~is_home] - E_loc], logical[~is_home])
            assert not torch.any(physical.flatten()[~is_home] // P_loc == logical[~is_home] // E_loc)
        assert sorted(totals[nominees].tolist()) == sorted(totals.tolist())[-R:]
        assert int(per_rank.sum()) == int(totals.sum())
        best = oracle_max_load(totals.tolist(), ep, nominees.tolist())
        assert int(per_rank.max()) == best, (counts, per_rank, best)


WORLD, B, S, FFN, E = 4, 2, 8, 16, 8
CASES = [("skew", 2, 0.6), ("one_expert", 1, 50.0)]  # (name, top_k, skew)


def run_case(case_id, top_k, skew, R, compiled, ep_mesh, etp_mesh, weights_mesh):
    from titan_fold.common.tensors import local
    from titan_fold.moe import MoEArgs
    from titan_fold.parallel.experts import expert_slice, shard_moe

    rank = dist.get_rank()
    args = MoEArgs(num_experts=E, top_k=top_k, moe_ffn_dim=FFN, load_balance="none", hot_expert_replicas=R)
    gen = torch.Generator().manual_seed(100 * case_id + rank)
    X = torch.randn(B, S, DIM, generator=gen, dtype=torch.float64).abs() + 0.5
    U = torch.randn(B, S, DIM, generator=gen, dtype=torch.float64)
    moe = make_layer(args, torch.float64, seed=case_id, skew=skew)
    full = {k: v.detach().clone().requires_grad_() for k, v in moe.named_parameters()}
    shard_moe(moe, ep_mesh, etp_mesh, None, weights_mesh=weights_mesh)
    x = X.clone().requires_grad_()
    # aot_eager: dynamo and AOT autograd trace the layer (the copies' collectives included) as the
    # trainer's compiled blocks do, without the CPU code generation's minutes
    y = (torch.compile(moe, backend="aot_eager") if compiled else moe)(x)
    (y * U).sum().backward()
    grads = {"router.gate.weight": moe.router.gate.weight.grad.double()}
    for name in ("w13", "w2"):
        g = torch.zeros_like(full[f"experts.{name}"])
        expert_slice(g, name, ep_mesh, etp_mesh).copy_(local(getattr(moe.experts, name).grad))
        grads[f"experts.{name}"] = g
    Xr = X.flatten(0, 1).clone().requires_grad_()
    y_ref, _, _ = reference_moe(Xr, full["router.gate.weight"], full["experts.w13"], full["experts.w2"], args)
    (y_ref * U.flatten(0, 1)).sum().backward()
    flat = torch.cat([g.flatten() for g in grads.values()] + [full[k].grad.flatten() for k in grads])
    dist.all_reduce(flat)
    half = flat.numel() // 2
    # the copies really ran: rows of some rank went to a copy
    with torch.no_grad():
        routing = moe.router(x.flatten(0, 1), S)
        counts = torch.bincount(routing.experts.flatten(), minlength=E)
        dist.all_reduce(counts)
        ep = ep_mesh.size()
        cap_ends = water_fill(counts, nominate(counts, R), ep)
        loads = counts.view(ep, -1).sum(1)
        assert int(loads.max()) > int(cap_ends.diff(prepend=cap_ends.new_zeros(1)).max()), "nothing moved"
    tol = dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(y.detach().flatten(0, 1), y_ref.detach(), **tol, msg="output")
    torch.testing.assert_close(x.grad.flatten(0, 1), Xr.grad, **tol, msg="input grad")
    torch.testing.assert_close(flat[:half], flat[half:], **tol, msg="router / expert weight grads")


def worker(rank, port, out_dir):
    start_rank(rank, port, WORLD, "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    failures = []
    # (ep, etp, copies R, compiled); edp = 4 / (ep x etp)
    # (ep2 runs eager in the trainer's tests: tests/test_hot_replicas_train.py)
    foldings = [(4, 1, 1, False), (2, 2, 2, False), (2, 1, 2, True)]
    for (ep, etp, R, compiled), (case_id, (name, top_k, skew)) in itertools.product(foldings, enumerate(CASES)):
        if compiled and name != "skew":  # one compilation: the tracing is the same for both loads
            continue
        mesh = init_device_mesh("cpu", (WORLD // (ep * etp), ep, etp), mesh_dim_names=("edp", "ep", "etp"))
        try:
            run_case(case_id, top_k, skew, R, compiled, mesh["ep"], mesh["etp"] if etp > 1 else None, mesh["ep", "etp"])
        except AssertionError as e:
            if not is_test_assertion(e):  # an invariant of titan_fold's: a crash
                raise
            failures.append(f"ep={ep} etp={etp} R={R} compiled={compiled} {name}:\n{traceback.format_exc()}")
    end_rank_checks(out_dir, rank, failures)


def test_replicas_match_reference(tmp_path):
    failures = fork_ranks(worker, WORLD, tmp_path)
    assert not failures, "\n".join(failures)[:20000]


def test_the_key_reaches_the_layers():
    from helpers import config

    from titan_fold.trainer.preflight import model_args_from_config

    ep2 = ("--parallelism.expert_parallel_degree", "2")
    _, args = model_args_from_config(config("debug_moe.toml", *ep2, "--moe.hot_expert_replicas", "3"))
    assert args.moe.hot_expert_replicas == 3


def test_layout_shows_the_copies_and_refuses_a_negative_count():
    from helpers import python_m

    args = ("--world-size", "4", "--ep", "2", "--model", "qwen2_moe/debug", "--placements", "--hot-expert-replicas")
    shown = python_m("titan_fold.layout", *args, "2")
    assert shown.returncode == 0, shown.stderr
    experts = [line for line in shown.stdout.splitlines() if ".moe.experts." in line]
    assert experts and all(line.endswith("summed over ep") for line in experts)
    refused = python_m("titan_fold.layout", *args, "-1")
    assert refused.returncode == 2 and refused.stderr == "error: --hot-expert-replicas -1: must be >= 0\n"
    at_ep1 = python_m(
        "titan_fold.layout", "--world-size", "4", "--model", "qwen2_moe/debug", "--hot-expert-replicas", "2"
    )
    assert at_ep1.returncode == 2 and at_ep1.stderr.startswith("error: --hot-expert-replicas 2 needs --ep > 1")
    assert len(at_ep1.stderr.splitlines()) == 1


def test_more_copies_than_experts_is_one_line_before_any_work():
    from helpers import config

    from titan_fold.common.values import ConfigError
    from titan_fold.trainer.preflight import preflight

    c = config("debug_moe.toml", "--parallelism.expert_parallel_degree", "2", "--moe.hot_expert_replicas", "9")
    with pytest.raises(ConfigError, match=r"^moe.hot_expert_replicas = 9: more copies than the model's 8 experts$"):
        preflight(c, 2)


def test_the_banner_says_the_copies_are_on():
    """A real run's start says the copies are on (moe.hot_expert_replicas > 0, so ep > 1: the
    rule refuses them at ep 1) and how many experts each rank runs; nothing without them."""
    import torch
    from helpers import config

    from titan_fold.trainer.banner import banner
    from titan_fold.trainer.preflight import model_args_from_config, preflight

    line = (
        "  copies of hot experts (moe.hot_expert_replicas): the 2 busiest experts of each layer call, "
        "spread over the ep ranks; 4 + 2 physical experts per rank"
    )
    ep2 = ("--parallelism.expert_parallel_degree", "2")
    for copies, shown in (("2", [line]), ("0", [])):
        c = config("debug_moe.toml", *ep2, "--moe.hot_expert_replicas", copies)
        layout = preflight(c, 2)
        text = banner(layout, model_args_from_config(c)[1], [torch.nn.Linear(4, 4)], c)
        assert [x for x in text.splitlines() if "copies" in x] == shown, text
