"""Layout tests on the fake process group, against an independent Megatron-Core reference."""

import json
import re
import time
from dataclasses import asdict

import pytest
import torch.distributed as dist
from helpers import Degrees, python_m, reference
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_fold import layout as layout_command
from titan_fold.common.errors import UserError
from titan_fold.parallel.mesh import Layout, LayoutError
from titan_fold.planning import layout as layout_cli
from titan_fold.planning.options import layout_parser


def test_reference_matches_paper_figure_2():
    # the reference itself against the paper's text: 4 GPUs, TP=ETP=2, EP=2
    ref = reference(4, pp=1, dpr=1, dps=2, cp=1, tp=2, ep=2, etp=2)
    assert ref["etp"] == [[0, 1], [2, 3]]
    assert ref["ep"] == [[0, 2], [1, 3]]
    assert ref["tp"] == [[0, 1], [2, 3]]
    assert ref["dp"] == [[0, 2], [1, 3]]


CONFIGS = [
    Degrees(world=1, pp=1, dpr=1, dps=1, cp=1, tp=1, ep=1, etp=1),
    Degrees(world=4, pp=1, dpr=1, dps=2, cp=1, tp=2, ep=2, etp=2),  # paper Figure 2
    Degrees(world=8, pp=1, dpr=1, dps=1, cp=8, tp=1, ep=8, etp=1),  # CP8 x EP8 folded on 8 GPUs
    Degrees(world=16, pp=1, dpr=1, dps=2, cp=2, tp=4, ep=8, etp=1),  # EP(8) > dp(2)
    Degrees(world=16, pp=1, dpr=1, dps=4, cp=1, tp=4, ep=16, etp=1),  # EP over the whole world
    Degrees(world=16, pp=1, dpr=2, dps=4, cp=1, tp=2, ep=2, etp=4),  # ETP(4) > TP(2), dp_replicate
    Degrees(world=16, pp=1, dpr=1, dps=2, cp=1, tp=8, ep=4, etp=1),  # ETP(1) < TP(8)
    Degrees(world=16, pp=1, dpr=2, dps=2, cp=1, tp=4, ep=16, etp=1),  # EP spans dp_replicate
    Degrees(world=32, pp=1, dpr=2, dps=2, cp=2, tp=4, ep=4, etp=2),  # everything > 1 but pp
    Degrees(world=64, pp=2, dpr=2, dps=4, cp=2, tp=2, ep=2, etp=2),  # the paper's listing degrees (with dp split)
    Degrees(world=64, pp=4, dpr=1, dps=4, cp=1, tp=4, ep=4, etp=1),  # pp > 1
    Degrees(world=128, pp=2, dpr=1, dps=4, cp=4, tp=4, ep=16, etp=2),  # pp, CP x TP attention, EP x ETP = 32 spans dp
    Degrees(world=256, pp=8, dpr=2, dps=4, cp=2, tp=2, ep=8, etp=1),
    Degrees(world=1024, pp=4, dpr=2, dps=8, cp=2, tp=8, ep=64, etp=2),
    Degrees(world=1024, pp=8, dpr=1, dps=64, cp=1, tp=2, ep=8, etp=1),  # Mixtral-8x22B-like folding at 1024 GPUs
    Degrees(world=1024, pp=1, dpr=4, dps=16, cp=4, tp=4, ep=256, etp=4),  # EP x ETP = world
]


@pytest.fixture
def fake_world():
    def init(world, rank=0):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_groups_match_megatron(cfg, fake_world):
    c = cfg
    ref = reference(**asdict(c))
    for rank in sorted({0, c.world // 3, c.world - 1}):
        fake_world(c.world, rank)
        layout = Layout(
            c.world, pp=c.pp, dp_replicate=c.dpr, cp=c.cp, tp=c.tp, ep=c.ep, etp=c.etp
        )  # dp_shard, edp derived
        assert (layout.dp_shard, layout.edp) == (c.dps, c.world // (c.pp * c.ep * c.etp))
        layout.build_mesh("cpu")
        assert layout.attention.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert layout.expert.mesh_dim_names == ("pp", "edp", "ep", "etp")
        for name, groups in ref.items():
            mesh, dim = ("expert", "pp") if name == "expert.pp" else (None, name)
            if rank == 0:  # whole-world lists (what the layout tool prints)
                assert layout.groups(dim, mesh) == groups, name
            # the real (flattened) DeviceMesh this rank holds is its reference group
            mine = [g for g in groups if rank in g]
            assert len(mine) == 1
            real = (layout.expert["pp"] if name == "expert.pp" else layout._meshes[name]).mesh.tolist()
            assert real == mine[0], (name, rank)


def test_torchtitan_names(fake_world):
    fake_world(32, rank=5)
    layout = Layout(32, pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4, etp=1)
    ref = reference(32, 2, 2, 2, 2, 2, 4, 1)
    group = lambda n: next(g for g in ref[n] if 5 in g)  # noqa: E731
    for tt, ours in (("batch", "dp"), ("loss", "dp_cp"), ("fsdp", "dp_shard_cp"), ("efsdp", "edp")):
        assert layout.get_mesh(tt) is layout.get_mesh(ours)
        assert layout.get_mesh(tt).mesh.tolist() == group(ours)
    for n in ("pp", "cp", "tp", "ep", "dp_replicate", "dp_shard"):
        assert layout.get_mesh(n).mesh.tolist() == group(n)
    assert layout.get_optional_mesh("etp") is None  # size 1 -> None (torchtitan semantics)
    with pytest.raises(ValueError, match="not available"):
        layout.get_mesh("etp")
    with pytest.raises(ValueError, match="Invalid mesh dim"):
        layout.get_mesh("nope")
    # torchtitan's HSDP: dp_replicate x fsdp; expert HSDP: dp_replicate x (edp / dp_replicate)
    hsdp = layout.get_mesh(["dp_replicate", "fsdp"])
    assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert sorted(hsdp.mesh.flatten().tolist()) == group("dp_cp")
    assert hsdp["dp_shard_cp"].mesh.tolist() == group("dp_shard_cp")
    ehsdp = layout.get_mesh(["dp_replicate", "efsdp"])
    assert ehsdp.shape == (2, 2) and sorted(ehsdp.mesh.flatten().tolist()) == group("edp")
    assert ehsdp["dp_replicate"].mesh.tolist() == group("dp_replicate")
    assert layout.get_optional_mesh(["ep", "etp"]) is None
    assert layout.get_mesh(["ep"]).mesh.tolist() == group("ep")
    assert set(layout.get_all_one_dimensional_meshes()) == {
        "pp",
        "dp_replicate",
        "dp_shard",
        "cp",
        "tp",
        "dp",
        "dp_shard_cp",
        "dp_cp",
        "cp_tp",
        "stage",
        "edp",
        "ep",
        "ep_etp",
    }
    # cp and tp are the fastest dims: a sequence's ranks are 4 consecutive ones; pp is the
    # slowest: a stage is 16 consecutive ranks
    assert layout.get_mesh("cp_tp").mesh.tolist() == [4, 5, 6, 7]
    assert layout.get_mesh("stage").mesh.tolist() == list(range(16))
    # ParallelDims properties the trainer reads
    assert layout.dp_enabled and layout.pp_enabled and layout.ep_enabled and not layout.etp_enabled
    assert layout.fsdp_gradient_divide_factor == 8 and layout.seq_len_divisor == 8
    assert layout.world_mesh is layout.attention


def test_efsdp_kept_with_ep_even_at_size_1(fake_world):
    fake_world(8)
    layout = Layout(8, tp=2, ep=8)  # edp = 1
    assert layout.get_optional_mesh("edp") is None
    assert layout.get_mesh("efsdp").size() == 1  # torchtitan wraps experts in FSDP whenever EP is on
    with pytest.raises(LayoutError, match="spans dp_replicate"):
        Layout(8, dp_replicate=2, tp=2, ep=8).get_mesh(["dp_replicate", "efsdp"])


@pytest.mark.parametrize(
    "kwargs, pieces",
    [
        (dict(world_size=8, tp=3), ["tp(3) = 3 must divide", "world_size / pp = 8 / 1 = 8", "tp in {2, 4, 8}"]),
        (
            dict(world_size=8, dp_shard=3, tp=2),
            ["pp(1) * dp_replicate(1) * dp_shard(3) * cp(1) * tp(2) = 6 != world_size(8)", "dp_shard=4"],
        ),
        (dict(world_size=8, ep=3), ["ep(3) * etp(1) = 3 must divide", "ep in {2, 4, 8}"]),
        (dict(world_size=8, ep=4, etp=4), ["ep(4) * etp(4) = 16", "ep in {1, 2}", "etp in {1, 2}"]),
        (
            dict(world_size=8, ep=4, edp=4),
            ["pp(1) * edp(4) * ep(4) * etp(1) = 16 != world_size(8)", "edp=-1 derives it (2)"],
        ),
        (dict(world_size=8, pp=3), ["pp(3) must divide world_size(8)", "valid pp: 2, 4, 8"]),
        (dict(world_size=8, tp=0), ["tp must be an integer >= 1, got 0"]),
        (dict(world_size=8, dp_shard=0), ["dp_shard must be -1 (derived) or an integer >= 1, got 0"]),
        (dict(world_size=12, dp_replicate=8), ["dp_replicate(8)", "valid neighbours: dp_replicate in {4, 6, 12}"]),
    ],
)
def test_degree_errors(kwargs, pieces):
    assert not dist.is_initialized()
    with pytest.raises(LayoutError) as err:
        Layout(**kwargs)
    for piece in pieces:
        assert piece in str(err.value), (piece, str(err.value))
    assert isinstance(err.value, ValueError)
    assert not dist.is_initialized()  # rejected before any process group


@pytest.mark.parametrize(
    "layout_kwargs, model, pieces",
    [
        (dict(ep=4), dict(num_experts=6), ["num_experts(6) % ep(4) = 2 != 0", "valid ep", ": 1, 2"]),
        (dict(ep=1, etp=8), dict(moe_ffn_dim=100), ["moe_ffn_dim(100) % etp(8) = 4 != 0", "valid etp: 1, 2, 4"]),
        (dict(tp=4), dict(n_heads=6), ["n_heads(6) % tp(4) = 2 != 0", "valid tp: 1, 2"]),
        (dict(tp=4), dict(n_heads=8, n_kv_heads=2), ["n_kv_heads(2) % tp(4) = 2 != 0", "valid tp: 1, 2"]),
        (dict(cp=4, tp=2), dict(seq_len=100), ["2 * cp(4)", "tp(2)", "seq_len % 16 = 4", "96, 112"]),
        (dict(cp=2), dict(seq_len=6), ["seq_len(6) % 2 * cp(2)", "= 2 != 0"]),
        (dict(tp=8), dict(seq_len=4), ["seq_len(4) % tp(8)"]),
    ],
)
def test_model_size_errors(layout_kwargs, model, pieces):
    layout = Layout(8, **layout_kwargs)
    with pytest.raises(LayoutError) as err:
        layout.validate(**model)
    for piece in pieces:
        assert piece in str(err.value), (piece, str(err.value))
    assert not dist.is_initialized()


def test_model_sizes_accepted():
    layout = Layout(8, tp=2, cp=2, ep=8)
    assert layout.validate(num_experts=64, moe_ffn_dim=2560, n_heads=28, n_kv_heads=4, seq_len=4096) is layout
    Layout(8, tp=8).validate(seq_len=4, sequence_parallel=False)  # no SP: tp needs no divisibility


FIGURE_2 = {
    "world_size": 4,
    "attention": {
        "degrees": {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2},
        "groups": {
            "pp": [[0], [1], [2], [3]],
            "dp": [[0, 2], [1, 3]],
            "cp": [[0], [1], [2], [3]],
            "tp": [[0, 1], [2, 3]],
            "dp_cp": [[0, 2], [1, 3]],
        },
    },
    "expert": {
        "degrees": {"pp": 1, "edp": 1, "ep": 2, "etp": 2},
        "groups": {
            "pp": [[0], [1], [2], [3]],
            "edp": [[0], [1], [2], [3]],
            "ep": [[0, 2], [1, 3]],
            "etp": [[0, 1], [2, 3]],
            "ep_etp": [[0, 1, 2, 3]],
        },
    },
}


@pytest.mark.parametrize("cfg", CONFIGS[1:12:2], ids=str)
def test_json_report_shape(cfg, fake_world):
    c = cfg
    fake_world(c.world)
    args = layout_parser().parse_args(
        f"--world-size {c.world} --pp {c.pp} --dp-replicate {c.dpr} --cp {c.cp} --tp {c.tp} --ep {c.ep} --etp {c.etp}".split()
    )
    rep = json.loads(json.dumps(layout_cli.report(layout_cli.build_layout(args))))
    ref = reference(**asdict(c))
    assert list(rep) == ["world_size", "attention", "expert"] and rep["world_size"] == c.world
    assert rep["attention"]["degrees"] == dict(pp=c.pp, dp_replicate=c.dpr, dp_shard=c.dps, cp=c.cp, tp=c.tp)
    assert rep["expert"]["degrees"] == dict(pp=c.pp, edp=c.world // (c.pp * c.ep * c.etp), ep=c.ep, etp=c.etp)
    assert rep["attention"]["groups"] == {n: ref[n] for n in ("pp", "dp", "cp", "tp", "dp_cp")}
    assert rep["expert"]["groups"] == {
        "pp": ref["expert.pp"],
        "edp": ref["edp"],
        "ep": ref["ep"],
        "etp": ref["etp"],
        "ep_etp": ref["ep_etp"],
    }


def test_table_and_png(fake_world, tmp_path):
    fake_world(16)
    args = layout_parser().parse_args("--world-size 16 --tp 2 --cp 2 --ep 8".split())
    rep = layout_cli.report(layout_cli.build_layout(args))
    text = layout_cli.table(rep, gpus_per_node=8)
    assert "world_size 16, 8 GPUs per node, 2 node(s)" in text
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.strip().startswith(("att.", "exp."))}
    assert "crossing 0/2 " in lines["exp.ep"] and "crossing 4/4 " in lines["att.dp"]
    assert "crossing 0/8 " in lines["att.tp"] and "crossing 8/8 " in lines["exp.edp"]
    rank9 = next(ln.split() for ln in text.splitlines() if ln.split()[:2] == ["9", "1"])
    assert rank9[2:] == ["9", "1*", "5", "4", "1*", "1*", "1", "9", "1"]
    out = tmp_path / "l.png"
    layout_cli.png(rep, str(out), gpus_per_node=8)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_world_4096_is_fast(fake_world):
    fake_world(4096)
    t = time.perf_counter()
    args = layout_parser().parse_args("--world-size 4096 --pp 4 --tp 4 --cp 2 --ep 16 --etp 2".split())
    rep = layout_cli.report(layout_cli.build_layout(args))
    layout_cli.table(rep, gpus_per_node=8)
    assert time.perf_counter() - t < 5.0
    assert len(rep["expert"]["groups"]["ep"]) == 256 and rep["expert"]["groups"]["ep"][1][:2] == [1, 3]


def test_cli_subprocess_json_and_error(capsys):
    out = python_m("titan_fold.layout", "--world-size", "4", "--tp", "2", "--ep", "2", "--etp", "2", "--format", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == FIGURE_2
    with pytest.raises(UserError, match=r"^expert mesh: ep\(3\) \* etp\(1\) = 3 must divide"):
        layout_command.main(["--world-size", "4", "--ep", "3"])
    refused = python_m("titan_fold.layout", "--world-size", "4", "--ep", "3")
    assert refused.returncode == 2 and refused.stderr.startswith("error: expert mesh: ep(3)"), refused.stderr
    assert len(refused.stderr.splitlines()) == 1
    assert not dist.is_initialized()


def test_torchtitan_set_determinism_takes_a_layout(fake_world):
    import torch
    from torchtitan.config.job_config import Debug
    from torchtitan.distributed.utils import set_determinism

    fake_world(16, rank=9)
    layout = Layout(16, pp=2, tp=2, ep=8)
    set_determinism(layout, torch.device("cpu"), Debug(seed=42), distinct_seed_mesh_dims=["pp"])
    assert torch.initial_seed() == 42 + 1  # rank 9 is in the second pipeline stage


def test_cli_placements_print_the_plan(capsys):
    argv = ["--world-size", "8", "--tp", "2", "--cp", "2", "--ep", "4", "--etp", "2", "--model", "qwen2_moe/debug"]
    assert layout_command.main(argv + ["--placements"]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    # experts: 8 of [2 x 32, 64] split 4 ways by expert and 2 ways by width
    assert lines["layers.0-3.moe.experts.w13"][1:7] == [
        "expert",
        "ep:Shard(0),",
        "etp:Shard(1)",
        "-",
        "8x64x64",
        "2x32x64",
    ]
    assert lines["layers.0-3.moe.experts.w2"][5:7] == ["8x64x32", "2x64x16"]
    assert lines["layers.0-3.attention.wo.weight"][1:4] == ["attention", "tp:Shard(1)", "RowwiseParallel"]
    assert lines["layers.0-3.moe.router.gate.weight"][2] == "tp:Replicate"
    # the model's sizes are checked too: 8 experts do not split 16 ways
    with pytest.raises(UserError, match=r"^num_experts\(8\) % ep\(16\)"):
        layout_command.main(["--world-size", "16", "--ep", "16", "--model", "qwen2_moe/debug"])
    with pytest.raises(UserError, match="^--placements needs --model$"):
        layout_command.main(["--world-size", "8", "--placements"])
    # under pp the stages follow the plan: the debug model's 4 blocks, embedding and head
    # counted as one block each
    pp = ["--world-size", "4", "--pp", "2", "--ep", "2", "--model", "qwen2_moe/debug", "--placements"]
    assert layout_command.main(pp) == 0
    assert capsys.readouterr().out.endswith(
        "pipeline stages (1F1B):\n"
        "stage 0 on pp rank 0: tok_embeddings, layers.0-1\n"
        "stage 1 on pp rank 1: layers.2-3, norm, output\n"
    )
    with pytest.raises(UserError, match="supported are"):
        layout_command.main(pp + ["--pp-schedule", "ZBVZeroBubble"])
    if dist.is_initialized():
        dist.destroy_process_group()


# refused layouts (config file, world size, overrides): each neighbour a refusal proposes, applied
# alone, passes the run's layout check (preflight's first) or is refused by a later part of it
# (the other mesh, then the model's sizes), never by the same one; following the hints always
# ends in a layout that passes
REFUSED = [
    pytest.param("qwen3_30b_a3b.toml", 2, [], id="qwen3_30b_at_2"),  # dp_shard 2 x cp 4, ep 8 x edp 1 given
    pytest.param("qwen3_30b_a3b.toml", 4, [], id="qwen3_30b_at_4"),
    pytest.param("qwen3_30b_a3b.toml", 8, ["--parallelism.context_parallel_degree", "2"], id="qwen3_30b_cp2_at_8"),
    pytest.param("qwen2.toml", 12, [], id="qwen2_at_12"),
    pytest.param("mixtral_8x22b.toml", 32, [], id="mixtral_at_32"),
    pytest.param(
        "debug_moe.toml",
        16,
        ["--parallelism.data_parallel_shard_degree", "3", "--parallelism.tensor_parallel_degree", "2"],
        id="dp_shard_given",
    ),
    pytest.param("debug_moe.toml", 16, ["--parallelism.expert_parallel_degree", "3"], id="ep3"),
    pytest.param(
        "debug_moe.toml",
        8,
        ["--parallelism.expert_parallel_degree", "2", "--parallelism.expert_data_parallel_degree", "2"],
        id="edp_given",
    ),
    pytest.param("debug_moe.toml", 8, ["--parallelism.tensor_parallel_degree", "8"], id="tp_past_kv_heads"),
    pytest.param(
        "debug_moe.toml",
        8,
        ["--parallelism.pipeline_parallel_degree", "3", "--parallelism.tensor_parallel_degree", "2"],
        id="pp3",
    ),
    pytest.param(
        "debug_moe.toml",
        24,
        ["--parallelism.expert_parallel_degree", "3", "--parallelism.expert_tensor_parallel_degree", "2"],
        id="ep3_etp2_at_24",
    ),
]


def proposed_neighbours(message: str) -> list[tuple[str, int]]:
    """(degree name, value) of every neighbour a LayoutError's line proposes."""
    found = [(name, int(v)) for name, v in re.findall(r"\b(dp_shard)=(\d+) \(or -1", message)]
    found += [("edp", -1)] if "edp=-1 derives it" in message else []
    for name, values in re.findall(r"\b(\w+) in \{([\d, ]+)\}", message):
        found += [(name, int(v)) for v in values.split(", ")]
    for name, values in re.findall(r"\bvalid (\w+)(?: \([^)]*\))?: ([\d, ]+\d)", message):
        found += [(name, int(v)) for v in values.split(", ")]
    return found


def _refused_check(message: str) -> str:
    """The check a refusal names (`attention mesh`, `num_experts(8) % ep`, ...), its numbers left out."""
    rule = message.split("): ", 1)[1]  # past "--key value, ... (world size N)"
    return re.sub(r"\(-?\d+\)|\d+", "", rule.split(";")[0].split(" = ")[0])


@pytest.mark.parametrize("config_file, world, overrides", REFUSED)
def test_every_proposed_neighbour_passes_or_moves_to_a_later_check(config_file, world, overrides):
    from titan_fold.common.config import parse_args
    from titan_fold.trainer.preflight import CHECKS, CONFIG_KEYS, Checked

    def check(extra: list[str]) -> None:
        dict(CHECKS)["layout"](Checked(parse_args(["--job.config_file", config_file, *overrides, *extra]), world))

    def follow(extra: list[str], refused: list[str]) -> int:
        """Check with extra; a refusal: each neighbour it proposes followed in turn; -> layouts that passed."""
        try:
            check(extra)
            return 1
        except LayoutError as e:
            chain = [*refused, str(e)]
            assert _refused_check(str(e)) not in map(_refused_check, refused), "\n".join(chain)
            neighbours = proposed_neighbours(str(e))
            assert neighbours, "\n".join(chain)  # a refusal proposes at least one neighbour
            return sum(follow([*extra, f"--{CONFIG_KEYS[n]}", str(v)], chain) for n, v in neighbours)

    with pytest.raises(LayoutError):
        check([])
    assert follow([], []) >= 1
