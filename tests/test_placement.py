"""The placement plan: written out by hand for six 8-rank layouts (a)-(f), and, layout
by layout, checked against what the parallelize step really builds.

The hand-written tables are the independent reference for the plan; the runtime tests build
the trainer's own model on the meta device, parallelize it on the fake process group (one
process, no memory, no communication) and compare every parameter's DTensor mesh and
placements, after TP, EP and FSDP2, with the plan's. Together: a placement changed in the
plan but not in the runtime, or in the runtime but not in the plan, fails here.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_fold.common.config import JobConfig, Parallelism
from titan_fold.models import FLAVORS, Transformer
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.parallelize import parallelize
from titan_fold.parallel.pipeline import stage_fqns, stage_model
from titan_fold.parallel.placement import format_plan, placement_plan

QWEN = FLAVORS["qwen2_moe"]["debug"]  # dim 64, 4 layers, 4/2 heads (head_dim 16), vocab 512, 8 experts x 32, shared 64

# suffix -> (tp placement, tp style of its module, global shape) for qwen2_moe debug
DENSE = {
    "tok_embeddings.weight": (Shard(0), "RowwiseParallel", (512, 64)),
    "attention_norm.weight": (Replicate(), "SequenceParallel", (64,)),
    "attention.wq.weight": (Shard(0), "ColwiseParallel", (64, 64)),
    "attention.wq.bias": (Shard(0), "ColwiseParallel", (64,)),
    "attention.wk.weight": (Shard(0), "ColwiseParallel", (32, 64)),
    "attention.wk.bias": (Shard(0), "ColwiseParallel", (32,)),
    "attention.wv.weight": (Shard(0), "ColwiseParallel", (32, 64)),
    "attention.wv.bias": (Shard(0), "ColwiseParallel", (32,)),
    "attention.wo.weight": (Shard(1), "RowwiseParallel", (64, 64)),
    "ffn_norm.weight": (Replicate(), "SequenceParallel", (64,)),
    "moe.router.gate.weight": (Replicate(), "TokenwiseReplicate", (8, 64)),
    "moe.shared_expert.w1.weight": (Shard(0), "ColwiseParallel", (64, 64)),
    "moe.shared_expert.w3.weight": (Shard(0), "ColwiseParallel", (64, 64)),
    "moe.shared_expert.w2.weight": (Shard(1), "RowwiseParallel", (64, 64)),
    "moe.shared_expert_gate.weight": (Replicate(), "TokenwiseReplicate", (1, 64)),
    "norm.weight": (Replicate(), "SequenceParallel", (64,)),
    "output.weight": (Shard(0), "ColwiseParallel", (512, 64)),
}
# suffix -> ((ep placement, etp placement), global shape, model-width dim)
EXPERTS = {
    "moe.experts.w13": ((Shard(0), Shard(1)), (8, 64, 64), 2),
    "moe.experts.w2": ((Shard(0), Shard(2)), (8, 64, 32), 1),
}

# name: (Layout kwargs, tp dims, dense FSDP mesh, expert dims, expert FSDP mesh)
LAYOUTS = {
    "a": (dict(tp=2, cp=2, ep=4, etp=2), ("tp",), ("dp_shard_cp",), ("ep", "etp"), ()),
    "b": (dict(tp=2, ep=8), ("tp",), ("dp_shard_cp",), ("ep",), ()),
    "c": (dict(cp=4, ep=2, etp=2), (), ("dp_shard_cp",), ("ep", "etp"), ("edp",)),
    "d": (dict(pp=2, tp=2, ep=4), ("tp",), ("dp_shard_cp",), ("ep",), ()),
    "e": (
        dict(dp_replicate=2, dp_shard=2, tp=2, ep=2, etp=2),
        ("tp",),
        ("dp_replicate", "dp_shard_cp"),
        ("ep", "etp"),
        ("edp",),
    ),
    "f": (dict(tp=4, ep=2), ("tp",), ("dp_shard_cp",), ("ep",), ("edp",)),
}


def _suffix(fqn, table):
    hits = [s for s in table if fqn == s or fqn.endswith("." + s)]
    assert len(hits) == 1, (fqn, hits)
    return hits[0]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_issue_layouts(name):
    kwargs, tp_dims, dense_fsdp, expert_dims, expert_fsdp = LAYOUTS[name]
    layout = Layout(8, **kwargs)
    plan = placement_plan(QWEN, layout)
    assert len(plan) == 3 + 4 * 16  # embedding, norm, output + per block 16 (qkv biases, shared expert + gate)
    for fqn, placed in plan.items():
        if ".moe.experts." in fqn:
            placements, shape, _ = EXPERTS[_suffix(fqn, EXPERTS)]
            by_dim = dict(zip(("ep", "etp"), placements, strict=True))
            assert placed.mesh == "expert", fqn
            assert placed.dims == expert_dims, fqn
            assert placed.placements == tuple(by_dim[d] for d in expert_dims), fqn
            assert (placed.tp_style, placed.fsdp_mesh, placed.fsdp_dim) == ("", expert_fsdp, 0), fqn
        else:
            placement, style, shape = DENSE[_suffix(fqn, DENSE)]
            assert placed.mesh == "attention", fqn
            assert placed.dims == tp_dims, fqn
            assert placed.placements == (placement,) * len(tp_dims), fqn
            assert placed.tp_style == (style if tp_dims else ""), fqn
            assert (placed.fsdp_mesh, placed.fsdp_dim) == (dense_fsdp, 0), fqn
        assert placed.shape == shape, fqn
        # the local piece: each Shard'ed tensor dim divided by the degree of its mesh dim
        local = list(shape)
        for dim, p in zip(placed.dims, placed.placements, strict=True):
            if isinstance(p, Shard):
                local[p.dim] //= getattr(layout, dim)
        assert placed.local_shape(layout) == tuple(local), fqn


def test_fsdp_shards_model_width_when_fewer_local_experts_than_edp():
    # 16 ranks, ep 8: one expert per ep rank, edp 2 -> FSDP cannot split dim 0 (size 1)
    plan = placement_plan(QWEN, Layout(16, tp=2, ep=8))
    assert plan["layers.0.moe.experts.w13"].fsdp_dim == 2  # [E, 2 * ffn, dim]: dim
    assert plan["layers.0.moe.experts.w2"].fsdp_dim == 1  # [E, dim, ffn]: dim
    assert plan["layers.0.moe.experts.w2"].fsdp_mesh == ("edp",)
    # 4 local experts over edp 4: dim 0 again
    assert placement_plan(QWEN, Layout(8, tp=4, ep=2))["layers.0.moe.experts.w13"].fsdp_dim == 0


def test_real_size_local_shapes():
    # Qwen2-57B-A14B under layout (a): 28 heads / 4 kv heads of 128, shared expert 20480
    plan = placement_plan(FLAVORS["qwen2_moe"]["57B-A14B"], Layout(8, tp=2, cp=2, ep=4, etp=2))
    layout = Layout(8, tp=2, cp=2, ep=4, etp=2)
    assert plan["layers.27.attention.wk.weight"].local_shape(layout) == (256, 3584)
    assert plan["layers.0.moe.shared_expert.w2.weight"].local_shape(layout) == (3584, 10240)
    assert plan["layers.0.moe.experts.w2"].local_shape(layout) == (16, 3584, 1280)
    assert plan["output.weight"].local_shape(layout) == (75968, 3584)


def test_format_plan_folds_blocks():
    layout = Layout(8, dp_replicate=2, dp_shard=2, tp=2, ep=2, etp=2)  # (e)
    text = format_plan(placement_plan(QWEN, layout), layout)
    lines = text.splitlines()
    assert lines[0].split() == ["parameter", "mesh", "placements", "tp_style", "shape", "local", "fsdp"]
    assert len(lines) == 1 + 3 + 16  # one line per distinct parameter, layers 0-3 folded
    wq = next(line for line in lines if line.startswith("layers.0-3.attention.wq.weight"))
    assert wq.split() == [
        "layers.0-3.attention.wq.weight",
        "attention",
        "tp:Shard(0)",
        "ColwiseParallel",
        "64x64",
        "32x64",
        "replicate",
        "dp_replicate;",
        "shard",
        "dim",
        "0",
        "over",
        "dp_shard_cp",
    ]
    w2 = next(line for line in lines if line.startswith("layers.0-3.moe.experts.w2"))
    assert w2.split() == [
        "layers.0-3.moe.experts.w2",
        "expert",
        "ep:Shard(0),",
        "etp:Shard(2)",
        "-",
        "8x64x32",
        "4x64x16",
        "shard",
        "dim",
        "0",
        "over",
        "edp",
    ]


# ---- the plan against the runtime, on the fake process group ------------------------------

MIXTRAL = dataclasses.replace(FLAVORS["mixtral"]["debug"], first_k_dense=1)  # one dense FFN block too
DEEPSEEK_MTP = dataclasses.replace(FLAVORS["deepseek_v3"]["debug"], mtp_layers=1)
DEEPSEEK_NO_Q_LORA = dataclasses.replace(FLAVORS["deepseek_v3"]["debug"], q_lora_rank=None)
# name: (world size, Layout kwargs, model, [section] key = value of the job config)
RUNTIME_LAYOUTS = {
    "one_rank": (1, dict(), QWEN, {}),
    "a_tp2_cp2_ep4_etp2": (8, dict(tp=2, cp=2, ep=4, etp=2), QWEN, {}),
    "b_tp2_ep8_moe_recompute": (8, dict(tp=2, ep=8), QWEN, {"activation_checkpoint.mode": "moe_layers"}),
    "c_cp4_ep2_etp2_edp2": (8, dict(cp=4, ep=2, etp=2), QWEN, {"activation_checkpoint.mode": "none"}),
    "d_pp2_tp2_ep4": (8, dict(pp=2, tp=2, ep=4), QWEN, {}),
    "e_hsdp_tp2_ep2_etp2": (8, dict(dp_replicate=2, dp_shard=2, tp=2, ep=2, etp=2), QWEN, {}),
    "f_tp4_ep2_edp4": (8, dict(tp=4, ep=2), MIXTRAL, {}),
    # one expert per ep rank, edp 2: FSDP shards the experts' model width
    "tp2_ep8_edp2_16_ranks": (16, dict(tp=2, ep=8), QWEN, {"activation_checkpoint.mode": "none"}),
    # experts on no model-parallel dim: plain tensors FSDP-sharded over edp (= dp x tp)
    "tp2_dp4_ep1": (8, dict(tp=2), MIXTRAL, {}),
    "dp_replicate2_only": (2, dict(dp_replicate=2), QWEN, {}),
    # multi-head latent attention (q LoRA: replicated down-projections) with an MTP layer; without q LoRA
    "deepseek_tp2_cp2_ep4_etp2_mtp": (8, dict(tp=2, cp=2, ep=4, etp=2), DEEPSEEK_MTP, {}),
    "deepseek_no_q_lora_pp2_tp4_ep2": (8, dict(pp=2, tp=4, ep=2), DEEPSEEK_NO_Q_LORA, {}),
}


@pytest.fixture
def fake_world():
    """init(world_size): a fake process group of that size, this process as rank 0."""

    def init(world_size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def parallelized_stages(model_args, layout: Layout, job_config) -> list[dict]:
    """Every pipeline stage built and parallelized as the trainer does it:
    -> [{parameter FQN without wrapper prefixes: parameter}] per stage."""
    with torch.device("meta"):
        model = Transformer(model_args)
    stages = stage_fqns(job_config.parallelism, model_args.n_layers, layout.pp) if layout.pp > 1 else None
    parts = [stage_model(model, fqns) for fqns in stages] if stages else [model]
    out = []
    for part in parts:
        parallelize(part, layout, job_config)
        out.append({fqn.replace("_checkpoint_wrapped_module.", ""): p for fqn, p in part.named_parameters()})
    return out


@pytest.mark.parametrize("name", sorted(RUNTIME_LAYOUTS))
def test_every_parameter_is_the_planned_dtensor(name, fake_world):
    """After parallelize (TP/SP, CP, EP x ETP, activation checkpointing, FSDP2), each parameter
    is the DTensor the printed plan describes: the same mesh dims, the same placements (FSDP2's
    first), the same global shape, on the planned pipeline stage; plain tensors where it says so."""
    world, kwargs, model_args, settings = RUNTIME_LAYOUTS[name]
    fake_world(world)
    layout = Layout(world, **kwargs)
    layout.build_mesh("cpu")
    job_config = JobConfig()
    for key, value in settings.items():
        section, field = key.split(".")
        setattr(getattr(job_config, section), field, value)
    stages = stage_fqns(job_config.parallelism, model_args.n_layers, layout.pp) if layout.pp > 1 else None
    plan = placement_plan(model_args, layout, stages)

    seen = []
    for stage, params in enumerate(parallelized_stages(model_args, layout, job_config)):
        for fqn, param in params.items():
            placed = plan[fqn]
            mesh_dims, placements = placed.dtensor(layout)
            if mesh_dims:
                assert isinstance(param, DTensor), fqn
                assert (param.device_mesh.mesh_dim_names, tuple(param.placements)) == (mesh_dims, placements), fqn
            else:
                assert not isinstance(param, DTensor), fqn
            assert tuple(param.shape) == placed.shape, fqn
            assert placed.stage == stage, fqn
            seen.append(fqn)
    assert sorted(seen) == sorted(plan)  # every planned parameter, each on one stage


def test_the_printed_plan_names_fsdp_strided_shards():
    """An example of the DTensor a plan line stands for: layout (a)'s wq is `tp:Shard(0)`, FSDP-sharded
    on dim 0 over dp_shard_cp, which already holds tp's pieces: FSDP2's shard interleaves with them."""
    layout = Layout(8, tp=2, cp=2, ep=4, etp=2)
    plan = placement_plan(QWEN, layout)
    assert plan["layers.0.attention.wq.weight"].dtensor(layout) == (
        ("dp_shard_cp", "tp"),
        (_StridedShard(0, split_factor=2), Shard(0)),
    )
    assert plan["layers.0.attention.wo.weight"].dtensor(layout) == (("dp_shard_cp", "tp"), (Shard(0), Shard(1)))
    assert plan["layers.0.moe.experts.w13"].dtensor(layout) == (("ep", "etp"), (Shard(0), Shard(1)))  # edp 1: no FSDP
    wide = Layout(16, tp=2, ep=8)
    assert placement_plan(QWEN, wide)["layers.0.moe.experts.w13"].dtensor(wide) == (("edp", "ep"), (Shard(2), Shard(0)))


def test_pipeline_stages_in_the_plan():
    layout = Layout(8, pp=2, tp=2, ep=4)
    stages = stage_fqns(Parallelism(pipeline_parallel_schedule="1F1B"), QWEN.n_layers, 2)
    plan = placement_plan(QWEN, layout, stages)
    assert {fqn: p.stage for fqn, p in plan.items() if not fqn.startswith("layers.")} == {
        "tok_embeddings.weight": 0,
        "norm.weight": 1,
        "output.weight": 1,
    }
    assert [plan[f"layers.{i}.attention.wq.weight"].stage for i in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("mode", ["none", "moe_layers", "full"])
def test_recompute_mode_wraps_what_it_names(mode, fake_world):
    """activation_checkpoint.mode = "moe_layers" checkpoints each MoE layer and nothing else;
    torchtitan's modes wrap whole blocks; "none" wraps nothing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    fake_world(1)
    layout = Layout(1)
    layout.build_mesh("cpu")
    job_config = JobConfig()
    job_config.activation_checkpoint.mode = mode
    with torch.device("meta"):
        model = Transformer(QWEN)
    parallelize(model, layout, job_config)
    blocks = list(model.layers.values())
    wrapped_blocks = [isinstance(b, CheckpointWrapper) for b in blocks]
    wrapped_moe = [isinstance(getattr(b, "moe", None), CheckpointWrapper) for b in blocks]
    assert wrapped_blocks == [mode == "full"] * len(blocks)
    assert wrapped_moe == [mode == "moe_layers" and b.moe_enabled for b in blocks]
