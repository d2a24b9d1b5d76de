"""`python -m titan_fold.plan --load-profile FILE --hot-expert-replicas R`: the measured imbalance
against plain-Python sums, the copies against replicas.py's exhaustive oracle, the command's
numbers and its bad inputs."""

import json
import random
from dataclasses import replace

import pytest
from helpers import python_m

from titan_fold.models import FLAVORS
from titan_fold.moe.replicas import oracle_max_load
from titan_fold.planning.cost_model import Cluster, Mapping, Workload, estimate
from titan_fold.planning.load import imbalance, rank_loads
from titan_fold.planning.sizes import model_sizes

# qwen2_moe/debug: 8 experts, 4 MoE layers
E, LAYERS = 8, 4
PLAN = (
    "titan_fold.plan",
    "--model",
    "qwen2_moe/debug",
    "--gpus",
    "8",
    "--gpus-per-node",
    "4",
    "--gpu-memory-gib",
    "1",
    "--reserve-gib",
    "0",
    "--seq-len",
    "128",
    "--global-batch",
    "16",
    "--top",
    "3",
)


def _by_hand(counts, ep):
    """Mean over layers of (busiest block of E / ep experts) / (mean block), in plain Python."""
    ratios = []
    for row in counts:
        n = len(row) // ep
        blocks = [sum(row[d * n : (d + 1) * n]) for d in range(ep)]
        ratios.append(max(blocks) / (sum(blocks) / ep))
    return sum(ratios) / len(ratios)


def _write(path, counts, step=7):
    layers = [f"layers.{i}" for i in range(len(counts))]
    balanced = {"step": step - 1, "layers": layers, "counts": [[5] * len(counts[0])] * len(counts)}
    path.write_text(json.dumps(balanced) + "\n" + json.dumps({"step": step, "layers": layers, "counts": counts}) + "\n")
    return str(path)


SKEWED = [
    [900, 300, 40, 30, 20, 10, 60, 40],
    [100, 100, 100, 100, 100, 100, 100, 100],
    [0, 0, 0, 0, 50, 700, 25, 25],
    [10, 20, 30, 40, 50, 60, 70, 80],
]


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_imbalance_without_copies_by_hand(ep):
    assert imbalance(SKEWED, ep, 0) == pytest.approx(_by_hand(SKEWED, ep), rel=1e-12)


def test_copies_reach_the_exhaustive_optimum():
    """Every small case: the copies' busiest rank is the exhaustive search's, never above the
    load without copies, and every row is still counted once."""
    rng = random.Random(0)
    for _ in range(40):
        ep, E_loc = rng.choice([(2, 2), (2, 3), (3, 2)])
        row = rng.sample(range(0, 13), ep * E_loc)  # distinct counts: one set of R busiest
        for R in (1, 2):
            nominees = sorted(range(len(row)), key=lambda e: -row[e])[:R]
            loads = rank_loads(row, ep, R)
            assert sum(loads) == sum(row), (row, ep, R, loads)
            assert max(loads) == oracle_max_load(row, ep, nominees), (row, ep, R, loads)
            with_copies, without = imbalance([row], ep, R), imbalance([row], ep, 0)
            assert with_copies == pytest.approx(max(loads) * ep / sum(row))
            assert with_copies <= without


def test_plan_with_a_skewed_profile(tmp_path):
    """Every ranked mapping is estimated at the profile's imbalance at its ep; copies even the
    skewed profile out, and their step time, all-reduces included, is below the one without."""
    profile = _write(tmp_path / "expert_load.jsonl", SKEWED)
    R = 2
    table = python_m(*PLAN, "--fix", "pp=1", "ep=4", "--load-profile", profile, "--hot-expert-replicas", str(R))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("measured load"))
    assert f"step 7): busiest ep rank's routed rows / mean, and step time, without / with {R}" in lines[at]
    assert lines[at + 1].split() == ["rank", "ep", "imbalance", "copies", "step", "s", "copies"]
    first = lines[at + 2].split()
    assert first[:2] == ["1", "4"] and float(first[2]) == pytest.approx(_by_hand(SKEWED, 4), abs=1e-3)

    out = python_m(
        *PLAN, "--fix", "pp=1", "ep=4", "--load-profile", profile, "--hot-expert-replicas", str(R), "--format", "json"
    )
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    load = rep["load_profile"]
    assert (load["step"], load["hot_expert_replicas"], load["file"]) == (7, R, profile)
    assert len(load["mappings"]) == len(rep["ranked"]) + 1  # and the best legacy mapping
    sizes = model_sizes(FLAVORS["qwen2_moe"]["debug"], 128, "qwen2_moe/debug")
    cluster = Cluster(**rep["cluster"])
    work = Workload(**rep["workload"])
    for ranked, row in zip(rep["ranked"], load["mappings"], strict=False):
        m = Mapping(**ranked["mapping"])
        assert row["mapping"] == ranked["mapping"] and row["ep"] == m.ep == 4
        assert row["imbalance"] == pytest.approx(_by_hand(SKEWED, 4), rel=1e-12)
        measured = estimate(sizes, m, replace(work, dropless_imbalance=_by_hand(SKEWED, 4)), cluster)
        assert row["step_s"] == ranked["step_s"] == pytest.approx(measured.step_s, rel=1e-9)
        assert row["imbalance_copies"] < row["imbalance"]
        # forward all-reduce of R experts' bf16 weights (etp shard), backward one of their
        # gradients, per MoE layer; a ring sends 2 (ep - 1) / ep of the buffer
        passes = 3 if m.recompute == "full" else 2
        sent = LAYERS * passes * 2 * (m.ep - 1) / m.ep * R * sizes.expert_params_per_layer / E / m.etp * 2
        gbps = cluster.inter_node_gbps if ranked["comm"]["ep"]["crossing"] else cluster.intra_node_gbps
        comm = sent / (gbps * 1e9 * cluster.comm_efficiency)
        assert row["copies_comm_s_per_microbatch"] == pytest.approx(comm, rel=1e-9)
        even = estimate(sizes, m, replace(work, dropless_imbalance=row["imbalance_copies"]), cluster)
        slots = work.global_batch // m.dp + m.pp - 1
        assert row["step_s_copies"] == pytest.approx(even.step_s + slots * comm, rel=1e-9)
        assert row["step_s_copies"] < row["step_s"], row


def test_without_a_profile_nothing_is_added():
    out = python_m(*PLAN, "--fix", "pp=1", "--format", "json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert "load_profile" not in rep and rep["workload"]["dropless_imbalance"] == 1.0


def _cases():
    good = [[10] * E] * LAYERS
    return {
        "missing": (None, [], "--load-profile {path}: cannot read it: No such file or directory"),
        "not json": ("{", [], "--load-profile {path}: the last line is not JSON"),
        "not a record": (
            json.dumps({"step": 1, "counts": good}),
            [],
            "--load-profile {path}: the last line is not a record",
        ),
        "negative": (
            json.dumps({"step": 1, "layers": ["a"] * LAYERS, "counts": [[-1] * E] * LAYERS}),
            [],
            "--load-profile {path}: the last line is not a record",
        ),
        "experts": (
            json.dumps({"step": 1, "layers": ["a"] * LAYERS, "counts": [[10] * (E - 1)] * LAYERS}),
            [],
            f"--load-profile {{path}}: a has {E - 1} experts, the model has {E}",
        ),
        "layers": (
            json.dumps({"step": 1, "layers": ["a"] * (LAYERS + 1), "counts": [[10] * E] * (LAYERS + 1)}),
            [],
            f"--load-profile {{path}}: {LAYERS + 1} layers, the model has {LAYERS} MoE layers",
        ),
        "no rows": (
            json.dumps({"step": 1, "layers": ["a", "b", "c", "d"], "counts": [[0] * E, *good[1:]]}),
            [],
            "--load-profile {path}: a routed no rows",
        ),
        "negative R": (
            json.dumps({"step": 1, "layers": ["a"] * LAYERS, "counts": good}),
            ["--hot-expert-replicas", "-1"],
            f"--hot-expert-replicas -1: must be in [0, {E}]",
        ),
        "R above E": (
            json.dumps({"step": 1, "layers": ["a"] * LAYERS, "counts": good}),
            ["--hot-expert-replicas", str(E + 1)],
            f"--hot-expert-replicas {E + 1}: must be in [0, {E}]",
        ),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_bad_profile_is_one_line_exit_2(tmp_path, case):
    text, extra, message = _cases()[case]
    path = tmp_path / "expert_load.jsonl"
    if text is not None:
        path.write_text(text + "\n")
    out = python_m(*PLAN, "--load-profile", str(path), *extra)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-2000:])
    assert lines[0].startswith("error: " + message.format(path=path)), lines
    assert out.stdout == ""


def test_replicas_need_a_profile():
    out = python_m(*PLAN, "--hot-expert-replicas", "2")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines == [
        "error: --hot-expert-replicas 2: needs --load-profile (the load the copies even out)"
    ]
