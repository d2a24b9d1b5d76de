"""The dry run's gradient check (`--comm.check_gradients`, titan_fold/dryrun/gradients.py):
what the placement plan implies per parameter, against hand-derived groups; the check on
the paper's 1024-rank layouts; and bugs that train silently wrong, each planted in a copy of
the code path it lives in, reported by parameter name (and gone once the plant is removed).
Packaged configs at their world sizes: tests/test_dryrun_match.py (the same recorded step)."""

import functools

import pytest
import torch
import torch.distributed as dist
from helpers import PAPER_1024, config
from torch.distributed.tensor import DTensor, Replicate

from titan_fold import dryrun
from titan_fold.dryrun.gradients import check_gradients, format_gradients
from titan_fold.parallel import attention, clip, parallelize, placement
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.reductions import Groups, expected
from titan_fold.trainer.preflight import layout_from_config


@pytest.fixture(autouse=True)
def no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def run(name, world, *overrides, ranks=(0,)):
    c = config(name, *overrides)
    _, args, _ = dryrun.check_config(c, world)
    rep = check_gradients(c, world, args, ranks=list(ranks))["gradients"]
    print("\n".join(format_gradients(rep)))
    return rep


def bad(rep) -> dict[str, list[str]]:
    """{parameter: its problems} over the simulated ranks."""
    out: dict[str, list[str]] = {}
    for m in rep["mismatches"]:
        out.setdefault(m["parameter"], []).append(m["problem"])
    return out


# ---------------------------------------------------------------- the plan's side


def test_expected_groups_of_qwen2_at_64():
    """qwen2.toml's layout (pp 4, dp_shard 8, tp 2 | edp 4, ep 4): rank 17's groups by hand."""
    c = config("qwen2.toml")
    layout, args, _ = dryrun.check_config(c, 64)
    plan = placement.placement_plan(args, layout)
    g = Groups(layout)
    stage = range(16, 32)  # rank 17: pp 1, dp_shard 0, tp 1 | edp 0, ep 0
    dp = {r for r in stage if r % 2 == 1}  # same tp coordinate
    want = {
        "layers.0.attention.wq.weight": dp,
        "layers.0.attention_norm.weight": set(stage),
        "layers.0.moe.router.gate.weight": set(stage),
        "layers.0.moe.experts.w13": {17, 21, 25, 29},  # edp: stride ep x etp = 4
    }
    for fqn, grad in want.items():
        exp = expected(plan[fqn], layout)
        assert g.group(17, exp.mesh, exp.grad_dims) == grad, fqn
        assert "pp" in exp.norm_dims
    # norm pieces: wq is sharded over dp_shard x tp (and pp), the norm weight over dp_shard only
    wq = expected(plan["layers.0.attention.wq.weight"], layout)
    assert g.group(17, "attention", wq.norm_dims) == {r + 16 * k for r in stage for k in (-1, 0, 1, 2)}
    norm = expected(plan["layers.0.attention_norm.weight"], layout)
    assert g.group(17, "attention", norm.norm_dims) == {r + 16 * k for r in dp for k in (-1, 0, 1, 2)}
    w13 = expected(plan["layers.0.moe.experts.w13"], layout)
    assert w13.norm_dims == ("pp", "edp", "ep")


def test_groups_agree_with_the_layout_tool():
    """Groups' rank sets and names against Layout.groups (the meshes' own group lists)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layout = Layout(64, pp=2, dp_replicate=2, cp=2, tp=2, ep=4, etp=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
    layout.build_mesh("cpu")
    g = Groups(layout)
    for mesh, names in (
        ("attention", ("dp_replicate", "dp_shard", "cp", "tp", "pp")),
        ("expert", ("edp", "ep", "etp")),
    ):
        for name in names:
            for members in layout.groups(name, mesh):
                for r in members[:2]:
                    assert g.group(r, mesh, (name,)) == set(members)
                    assert g.name(r, members, mesh) == name
    # a reduce-scatter over dp_shard then an all-reduce over dp_replicate reach dp_replicate x dp_shard
    r = 5
    rs = g.group(r, "attention", ("dp_shard",))
    ar = g.group(r, "attention", ("dp_replicate",))
    assert g.closure(r, [rs, ar]) == g.group(r, "attention", ("dp_replicate", "dp_shard"))
    assert g.name(r, g.closure(r, [rs, ar])) == "dp_replicate x dp_shard"
    assert g.name(r, {r}) == "none"
    assert g.name(r, {0, 63}).startswith("ranks [0, 63]")


# ---------------------------------------------------------------- the paper's layouts


@pytest.mark.slow
@pytest.mark.parametrize("label", sorted(PAPER_1024))
def test_paper_1024_rank_layouts_gradients(label):
    """The first and the last rank of the first and the last pipeline stage."""
    name, overrides = PAPER_1024[label]
    c = config(name, *overrides)
    layout = layout_from_config(c, 1024)
    per_stage = 1024 // layout.pp
    ranks = [0, per_stage - 1, 1024 - per_stage, 1023]
    rep = run(name, 1024, *overrides, ranks=ranks)
    assert rep["ranks"] == ranks and not rep["mismatches"]
    kinds = {r["kind"] for r in rep["table"]}
    assert {"attention", "embeddings", "head", "norms", "routed experts", "router"} <= kinds
    # the norms' gradients over every attention rank of a stage but pp; the experts' over edp
    rows = {(r["kind"], r["grad_plan"]) for r in rep["table"]}
    stage = " x ".join(d for d in ("dp_shard", "cp", "tp") if layout.size(d) > 1)
    assert ("norms", stage) in rows and ("routed experts", "edp") in rows


# ---------------------------------------------------------------- planted bugs

# debug_moe on 8 ranks: attention dp_shard 4 x tp 2, experts edp 2 x ep 4 (FSDP on both meshes)
TP2_EP4 = (
    "--parallelism.tensor_parallel_degree",
    "2",
    "--parallelism.expert_parallel_degree",
    "4",
    "--training.local_batch_size",
    "1",
)


@pytest.mark.slow
def test_unplanted_layouts_match():
    """The layouts the plants below run in, as shipped: every parameter matches."""
    assert not run("debug_moe.toml", 8, *TP2_EP4, ranks=[0, 7])["mismatches"]
    assert not run(
        "debug_moe.toml", 2, "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"
    )["mismatches"]
    assert not run(
        "debug_moe.toml",
        8,
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.expert_tensor_parallel_degree",
        "2",
        "--training.local_batch_size",
        "1",
    )["mismatches"]


@pytest.mark.slow
def test_rowwise_bias_is_whole_on_every_tp_rank():
    """wo with a bias (Qwen3's attention_bias): replicated on tp like the norms, but added after
    wo's reduction: its gradient is whole on each tp rank, the plan sums it over dp only."""
    c = config("debug_moe.toml", *TP2_EP4)
    layout, args, _ = dryrun.check_config(c, 8)
    args.out_bias = True
    plan = placement.placement_plan(args, layout)
    assert not plan["layers.0.attention.wo.bias"].tp_partial_grad
    assert (
        plan["layers.0.attention_norm.weight"].tp_partial_grad
        and plan["layers.0.moe.router.gate.weight"].tp_partial_grad
    )
    rep = check_gradients(c, 8, args, ranks=[0])["gradients"]
    assert rep["mismatches"] == []
    rows = {(r["grad_plan"], r["grad_recorded"]) for r in rep["table"] if "attention.wo.bias" in r["params"]}
    assert rows == {("dp_shard", "dp_shard")}


@pytest.mark.slow
def test_router_never_summed_over_tp(monkeypatch):
    """TokenwiseReplicate declaring each tp rank's token rows replicated: DTensor then sees a
    complete router gradient on every tp rank and nothing sums it over tp."""
    monkeypatch.setattr(
        placement.TokenwiseReplicate,
        "_input",
        staticmethod(
            lambda module, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
            )
        ),
    )
    found = bad(run("debug_moe.toml", 8, *TP2_EP4))
    assert set(found) == {f"layers.{i}.moe.{p}.weight" for i in (0, 1) for p in ("router.gate", "shared_expert_gate")}
    assert all("gradient summed over dp_shard, the plan says dp_shard x tp" in p for ps in found.values() for p in ps)


@pytest.mark.slow
def test_norm_never_summed_over_tp(monkeypatch):
    """Without FSDP (tp 2 on 2 ranks) the partial gradients of the norms are made whole by
    `_grads_like_params`; a copy that takes the local sum for the whole one."""

    def local_shortcut(model):
        def hook(param):
            g = param.grad
            if g is not None and any(p.is_partial() for p in g.placements):
                param.grad = DTensor.from_local(g.to_local(), g.device_mesh, param.placements, run_check=False)
            elif g is not None and g.placements != param.placements:
                param.grad = g.redistribute(placements=param.placements)

        def register(module, args):
            for param in module.parameters():
                if isinstance(param, DTensor) and not getattr(param, "_planted", False):
                    param.register_post_accumulate_grad_hook(hook)
                    param._planted = True

        model.register_forward_pre_hook(register)

    monkeypatch.setattr(attention, "_grads_like_params", local_shortcut)
    found = bad(
        run(
            "debug_moe.toml",
            2,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
        )
    )
    norms = {"norm.weight", *(f"layers.{i}.{n}.weight" for i in (0, 1) for n in ("attention_norm", "ffn_norm"))}
    assert norms <= set(found)
    assert "gradient summed over none, the plan says tp" in found["layers.0.attention_norm.weight"][0]
    assert not any("wq" in fqn or "experts" in fqn for fqn in found)  # sharded on tp: nothing to sum


@pytest.mark.slow
def test_replicated_parameter_counted_tp_times_in_the_norm(monkeypatch):
    """A copy of clip.total_norm that sums every rank's local norm over every dim of the
    gradients' mesh, replicated dims included."""

    def counts_every_replica(grads, norm_type, error_if_nonfinite=False):
        local = torch.stack(
            [
                torch.linalg.vector_norm(g.to_local() if isinstance(g, DTensor) else g, norm_type, dtype=torch.float32)
                for g in grads
            ]
        )
        total = torch.linalg.vector_norm(local, norm_type) ** norm_type
        if isinstance(grads[0], DTensor):
            for d in range(grads[0].device_mesh.ndim):
                dist.all_reduce(total, group=grads[0].device_mesh.get_group(d))
        return total ** (1.0 / norm_type)

    monkeypatch.setattr(clip, "total_norm", counts_every_replica)
    found = bad(run("debug_moe.toml", 8, *TP2_EP4))
    replicated = {
        "norm.weight",
        *(
            f"layers.{i}.{n}.weight"
            for i in (0, 1)
            for n in ("attention_norm", "ffn_norm", "moe.router.gate", "moe.shared_expert_gate")
        ),
    }
    assert set(found) == replicated
    assert found["layers.0.ffn_norm.weight"] == [
        "norm counts each piece 2 times (plan: once over dp_shard; recorded: summed over dp_shard x tp)"
    ]
    assert all(len(ps) == 1 and ps[0].startswith("norm counts each piece 2 times") for ps in found.values())


def _all_reduce(g, group):
    dist.all_reduce(g, group=group)


def _plant_in_expert_fsdp(monkeypatch, plant):
    """apply_fsdp as shipped, then `plant(experts unit, layout)` on every MoE layer's experts."""
    from titan_fold.moe import moe_layers

    real = parallelize.apply_fsdp

    def planted(model, layout, plan, job_config):
        real(model, layout, plan, job_config)
        for moe in moe_layers(model):
            plant(moe.experts, layout)

    monkeypatch.setattr(parallelize, "apply_fsdp", planted)


EXPERTS = {f"layers.{i}.moe.experts.{w}" for i in (0, 1) for w in ("w13", "w2")}


@pytest.mark.slow
def test_skipped_reduce_scatter(monkeypatch):
    """The experts' FSDP unit left out of gradient sync: no reduce-scatter over edp."""
    _plant_in_expert_fsdp(monkeypatch, lambda unit, layout: unit.set_requires_gradient_sync(False))
    found = bad(run("debug_moe.toml", 8, *TP2_EP4))
    assert set(found) == EXPERTS
    assert "no gradient reached the optimizer" in found["layers.0.moe.experts.w13"]
    assert "gradient summed over none, the plan says edp" in found["layers.0.moe.experts.w13"]


@pytest.mark.slow
def test_extra_reduction(monkeypatch):
    """Expert gradients also all-reduced over ep after FSDP's reduce-scatter (as if ep
    were data parallel)."""
    _plant_in_expert_fsdp(
        monkeypatch,
        lambda unit, layout: unit.set_all_reduce_hook(
            functools.partial(_all_reduce, group=layout.get_mesh("ep").get_group())
        ),
    )
    found = bad(run("debug_moe.toml", 8, *TP2_EP4))
    assert set(found) == EXPERTS
    assert found["layers.1.moe.experts.w2"] == ["gradient summed over edp x ep, the plan says edp"]


@pytest.mark.slow
def test_divided_by_the_wrong_degree(monkeypatch):
    """Expert gradients divided by ep (FSDP's divide factor) though the loss is already a
    mean over every token of the step."""
    _plant_in_expert_fsdp(monkeypatch, lambda unit, layout: unit.set_gradient_divide_factor(float(layout.ep)))
    found = bad(run("debug_moe.toml", 8, *TP2_EP4))
    assert set(found) == EXPERTS
    assert found["layers.0.moe.experts.w13"] == [
        "gradient scaled by 1/4 besides its sum over edp (plan: a plain sum, "
        "the loss is already divided by the step's token count)"
    ]


@pytest.mark.slow
def test_reduced_over_tp_where_ep_equals_tp(monkeypatch):
    """ep = tp = 2 with etp 2: the expert gradients summed over the tp group, which has ep's
    size but other ranks (the etp group here): named by its dims, not passed for its size."""
    _plant_in_expert_fsdp(
        monkeypatch,
        lambda unit, layout: unit.set_all_reduce_hook(
            functools.partial(_all_reduce, group=layout.get_mesh("tp").get_group())
        ),
    )
    found = bad(
        run(
            "debug_moe.toml",
            8,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--parallelism.expert_tensor_parallel_degree",
            "2",
            "--training.local_batch_size",
            "1",
        )
    )
    assert set(found) == EXPERTS
    assert found["layers.0.moe.experts.w13"] == ["gradient summed over edp x etp, the plan says edp"]


@pytest.mark.slow
def test_one_parameter_listed_twice_for_the_norm(monkeypatch):
    """mixtral_8x22b.toml at 128 ranks, a rank of the last stage: the trainer hands the clip
    the final norm's weight twice. One parameter among the stage's, named alone."""
    from titan_fold.trainer.fold_trainer import FoldTrainer

    real = FoldTrainer.clip_grad_norm

    def twice(self, parameters, *args, **kwargs):
        extra = [p for part in self.model_parts for name, p in part.named_parameters() if name == "norm.weight"]
        return real(self, [*parameters, *extra], *args, **kwargs)

    monkeypatch.setattr(FoldTrainer, "clip_grad_norm", twice)
    found = bad(run("mixtral_8x22b.toml", 128, ranks=[127]))
    assert found == {
        "norm.weight": [
            "norm counts each piece 2 times (plan: once over pp x dp_shard; recorded: summed over pp x dp_shard x tp)"
        ]
    }


@pytest.mark.slow
def test_command_prints_the_table_and_exits_1_on_a_mismatch(tmp_path, monkeypatch, capsys):
    """`--comm.check_gradients` on the dry run (without the collective check: one rank per
    position): the table and exit 0; with the experts divided by ep, their lines and exit 1."""
    from titan_fold.train import main

    monkeypatch.setenv("NGPU", "8")
    args = [
        "--job.config_file",
        "debug_moe.toml",
        "--comm.mode",
        "fake_backend",
        "--comm.check_gradients",
        "--comm.no-dry_run_collectives",
        *TP2_EP4,
        "--comm.dry_run_json",
        str(tmp_path / "dry.json"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gradients of one step against the placement plan on 2 rank(s): every parameter matches" in out
    assert "on ranks [0, 7] (one per position" in out
    for kind in ("attention", "norms", "router", "shared expert", "routed experts", "embeddings", "head"):
        assert f"\n  {kind} " in out
    _plant_in_expert_fsdp(monkeypatch, lambda unit, layout: unit.set_gradient_divide_factor(float(layout.ep)))
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "MISMATCH layers.0.moe.experts.w13 on rank 7: gradient scaled by 1/4 besides its sum over edp" in out


# ---------------------------------------------------------------- copies of hot experts
COPIES = (
    "--parallelism.expert_parallel_degree",
    "2",
    "--moe.hot_expert_replicas",
    "2",
    "--training.local_batch_size",
    "2",
)
COPIED = {f"layers.{i}.moe.experts.{w} copies" for i in (0, 1) for w in ("w13", "w2")}


def _plant_in_copies(monkeypatch, change):
    """The copies' backward with its gradient for the home weights changed by `change`."""
    from titan_fold.moe import replicas

    backward = replicas._Copies.backward

    def planted(ctx, grad):
        grad_w, *rest = backward(ctx, grad)
        return (change(grad_w), *rest)

    monkeypatch.setattr(replicas._Copies, "backward", staticmethod(planted))


@pytest.mark.slow
def test_copies_gradients_go_home_once_over_ep():
    rep = run("debug_moe.toml", 4, *COPIES, ranks=(0, 1))
    assert not rep["mismatches"]
    rows = [r for r in rep["table"] if r["kind"] == "expert copies"]
    assert len(rows) == 1 and rows[0]["grad_recorded"] == "ep" and rows[0]["ranks"] == 2
    assert {f"{p.split(' ')[0]}" for p in rows[0]["params"]} == {"moe.experts.w13", "moe.experts.w2"}


@pytest.mark.slow
def test_copies_gradient_dropped(monkeypatch):
    _plant_in_copies(monkeypatch, lambda g: None)
    found = bad(run("debug_moe.toml", 4, *COPIES, ranks=(0, 1)))
    assert set(found) == COPIED
    assert (
        "copies' gradient reached the home expert 0 time(s) in 1 backward pass(es)"
        in found["layers.0.moe.experts.w13 copies"]
    )


@pytest.mark.slow
def test_copies_gradient_counted_twice(monkeypatch):
    _plant_in_copies(monkeypatch, lambda g: 2 * g)
    found = bad(run("debug_moe.toml", 4, *COPIES, ranks=(0, 1)))
    assert set(found) <= COPIED and found
    assert all(p == ["copies' gradient reached the home expert x 2 (plan: once)"] for p in found.values()), found


@pytest.mark.slow
def test_copies_the_layer_never_made(monkeypatch):
    """The plan gives the expert weights copies, but the layer routes without them."""
    from titan_fold.moe import exchange

    monkeypatch.setattr(exchange, "plan_copies", lambda d, experts_idx, args: (experts_idx, args, None))
    found = bad(run("debug_moe.toml", 4, *COPIES, ranks=(0,)))
    assert set(found) == COPIED
    assert found["layers.1.moe.experts.w2 copies"][0] == "the plan has copies summed over ep, the layer made none"


def test_the_placement_plan_gives_expert_weights_copies():
    """`python -m titan_fold.layout --placements --hot-expert-replicas R`: the routed experts'
    weights, and only they, have copies whose gradients are summed over ep; none at ep 1."""
    c = config("debug_moe.toml", *COPIES)
    _, args, _ = dryrun.check_config(c, 4)
    plan = placement.placement_plan(args, layout_from_config(c, 4))
    routed = {
        f"layers.{i}.moe.experts.{w}" for i in range(args.n_layers) if args.is_moe_layer(i) for w in ("w13", "w2")
    }
    assert routed and {fqn for fqn, p in plan.items() if p.copies_grad} == routed
    assert all(p.copies_grad == ("ep",) for p in plan.values() if p.copies_grad)
    assert "copies' gradients" in placement.format_plan(plan) and "summed over ep" in placement.format_plan(plan)
    # the copies' model at one rank (a config refuses copies at ep 1: moe.hot_expert_replicas' rule)
    one = config("debug_moe.toml")
    assert not any(p.copies_grad for p in placement.placement_plan(args, layout_from_config(one, 1)).values())
