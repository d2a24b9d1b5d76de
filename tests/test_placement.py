"""The placement plan for the issue's 8-rank layouts (a)-(f), written out by hand.

No process group: the plan is arithmetic on the layout's degrees. The 8-rank gloo test
(test_attention_parallel.py) checks that apply_tp lays parameters out as this plan says.
"""

import pytest
from torch.distributed.tensor import Replicate, Shard

from titan_fold.models import FLAVORS
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.placement import format_plan, placement_plan

QWEN = FLAVORS["qwen2_moe"]["debug"]  # dim 64, 4 layers, 4/2 heads (head_dim 16), vocab 512, 8 experts x 32, shared 64

# suffix -> (tp placement, global shape) for qwen2_moe debug
DENSE = {
    "tok_embeddings.weight": (Shard(0), (512, 64)),
    "attention_norm.weight": (Replicate(), (64,)),
    "attention.wq.weight": (Shard(0), (64, 64)),
    "attention.wq.bias": (Shard(0), (64,)),
    "attention.wk.weight": (Shard(0), (32, 64)),
    "attention.wk.bias": (Shard(0), (32,)),
    "attention.wv.weight": (Shard(0), (32, 64)),
    "attention.wv.bias": (Shard(0), (32,)),
    "attention.wo.weight": (Shard(1), (64, 64)),
    "ffn_norm.weight": (Replicate(), (64,)),
    "moe.router.gate.weight": (Replicate(), (8, 64)),
    "moe.shared_expert.w1.weight": (Shard(0), (64, 64)),
    "moe.shared_expert.w3.weight": (Shard(0), (64, 64)),
    "moe.shared_expert.w2.weight": (Shard(1), (64, 64)),
    "moe.shared_expert_gate.weight": (Replicate(), (1, 64)),
    "norm.weight": (Replicate(), (64,)),
    "output.weight": (Shard(0), (512, 64)),
}
# suffix -> ((ep placement, etp placement), global shape, hidden dim)
EXPERTS = {
    "moe.experts.w1": ((Shard(0), Shard(1)), (8, 32, 64), 2),
    "moe.experts.w3": ((Shard(0), Shard(1)), (8, 32, 64), 2),
    "moe.experts.w2": ((Shard(0), Shard(2)), (8, 64, 32), 1),
}

# name: (Layout kwargs, tp dims, dense fsdp (replicate, shard), expert dims, expert fsdp shard dims)
LAYOUTS = {
    "a": (dict(tp=2, cp=2, ep=4, etp=2), ("tp",), ((), ("dp_shard", "cp")), ("ep", "etp"), ()),
    "b": (dict(tp=2, ep=8), ("tp",), ((), ("dp_shard",)), ("ep",), ()),
    "c": (dict(cp=4, ep=2, etp=2), (), ((), ("dp_shard", "cp")), ("ep", "etp"), ("edp",)),
    "d": (dict(pp=2, tp=2, ep=4), ("tp",), ((), ("dp_shard",)), ("ep",), ()),
    "e": (dict(dp_replicate=2, dp_shard=2, tp=2, ep=2, etp=2), ("tp",), (("dp_replicate",), ("dp_shard",)), ("ep", "etp"), ("edp",)),
    "f": (dict(tp=4, ep=2), ("tp",), ((), ("dp_shard",)), ("ep",), ("edp",)),
}


def _suffix(fqn, table):
    hits = [s for s in table if fqn == s or fqn.endswith("." + s)]
    assert len(hits) == 1, (fqn, hits)
    return hits[0]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_issue_layouts(name):
    kwargs, tp_dims, (dense_rep, dense_shard), expert_dims, expert_shard = LAYOUTS[name]
    layout = Layout(8, **kwargs)
    plan = placement_plan(QWEN, layout)
    assert len(plan) == 3 + 4 * 17  # embedding, norm, output + per block 17 (qkv biases, shared expert + gate)
    for fqn, placed in plan.items():
        if ".moe.experts." in fqn:
            placements, shape, hidden = EXPERTS[_suffix(fqn, EXPERTS)]
            by_dim = dict(zip(("ep", "etp"), placements))
            assert placed.mesh == "expert", fqn
            assert placed.dims == expert_dims, fqn
            assert placed.placements == tuple(by_dim[d] for d in expert_dims), fqn
            assert (placed.fsdp_replicate, placed.fsdp_shard, placed.fsdp_dim) == ((), expert_shard, 0), fqn
        else:
            placement, shape = DENSE[_suffix(fqn, DENSE)]
            assert placed.mesh == "attention", fqn
            assert placed.dims == tp_dims, fqn
            assert placed.placements == (placement,) * len(tp_dims), fqn
            assert (placed.fsdp_replicate, placed.fsdp_shard) == (dense_rep, dense_shard), fqn
            assert placed.fsdp_dim == 0, fqn
        assert placed.shape == shape, fqn
        # the local piece: each Shard'ed tensor dim divided by the degree of its mesh dim
        local = list(shape)
        for dim, p in zip(placed.dims, placed.placements):
            if isinstance(p, Shard):
                local[p.dim] //= getattr(layout, dim)
        assert placed.local_shape(layout) == tuple(local), fqn


def test_fsdp_shards_hidden_dim_when_fewer_local_experts_than_edp():
    # 16 ranks, ep 8: one expert per ep rank, edp 2 -> FSDP cannot split dim 0 (size 1)
    plan = placement_plan(QWEN, Layout(16, tp=2, ep=8))
    assert plan["layers.0.moe.experts.w1"].fsdp_dim == 2  # [E, ffn, dim]: dim
    assert plan["layers.0.moe.experts.w2"].fsdp_dim == 1  # [E, dim, ffn]: dim
    assert plan["layers.0.moe.experts.w2"].fsdp_shard == ("edp",)
    # 4 local experts over edp 4: dim 0 again
    assert placement_plan(QWEN, Layout(8, tp=4, ep=2))["layers.0.moe.experts.w1"].fsdp_dim == 0


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
    assert lines[0].split() == ["parameter", "mesh", "placements", "shape", "local", "fsdp"]
    assert len(lines) == 1 + 3 + 17  # one line per distinct parameter, layers 0-3 folded
    wq = next(line for line in lines if line.startswith("layers.0-3.attention.wq.weight"))
    assert wq.split() == [
        "layers.0-3.attention.wq.weight", "attention", "tp:Shard(0)", "64x64", "32x64",
        "replicate", "dp_replicate;", "shard", "dim", "0", "over", "dp_shard",
    ]
    w2 = next(line for line in lines if line.startswith("layers.0-3.moe.experts.w2"))
    assert w2.split() == [
        "layers.0-3.moe.experts.w2", "expert", "ep:Shard(0),", "etp:Shard(2)", "8x64x32", "4x64x16",
        "shard", "dim", "0", "over", "edp",
    ]
