"""The folding planner: enumeration against the trainer's validation, memory by hand, paper cases."""

import itertools
import json
import os
import sys

import pytest
import torch.distributed as dist
from helpers import python_m

from titan_fold.common.config import parse_args
from titan_fold.models import FLAVORS, TransformerArgs
from titan_fold.moe import MoEArgs
from titan_fold.parallel.mesh import Layout, LayoutError
from titan_fold.planning.cost_model import (
    Cluster,
    Mapping,
    Workload,
    activation_bytes,
    estimate,
    group_membership,
    memory,
)
from titan_fold.planning.search import enumerate_mappings, job_toml, min_gpus, plan
from titan_fold.planning.sizes import model_sizes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.planned import latest_record, pairs  # noqa: E402


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _brute_force(world, args, seq_len):
    """Every (pp, dp_replicate, cp, tp, ep, etp) from the divisors, derived dp_shard/edp, that Layout accepts."""
    accepted = set()
    for pp, dpr, cp, tp, ep, etp in itertools.product(_divisors(world), repeat=6):
        try:
            lay = Layout(world, pp=pp, dp_replicate=dpr, cp=cp, tp=tp, ep=ep, etp=etp)
            lay.validate(
                num_experts=args.moe.num_experts,
                moe_ffn_dim=args.moe.moe_ffn_dim,
                n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads,
                seq_len=seq_len,
            )
        except LayoutError:
            continue
        accepted.add((pp, dpr, lay.dp_shard, cp, tp, ep, etp, lay.edp))
    return accepted


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_enumeration_is_exactly_what_layout_accepts(family):
    args = FLAVORS[family]["debug"]
    seq_len = 24  # 24 % (2 cp) rules out cp 8 and cp 16 (and cp 3 ... never a divisor here)
    sizes = model_sizes(args, seq_len)
    worlds = range(1, 17) if family == "qwen2_moe" else (6, 8, 12, 16)
    for world in worlds:
        got = enumerate_mappings(world, sizes, seq_len)
        keys = [(m.pp, m.dp_replicate, m.dp_shard, m.cp, m.tp, m.ep, m.etp, m.edp) for m in got]
        assert len(keys) == len(set(keys))
        assert set(keys) == _brute_force(world, args, seq_len), world
        for m in got:  # explicit degrees (nothing derived) pass too
            Layout(
                world,
                pp=m.pp,
                dp_replicate=m.dp_replicate,
                dp_shard=m.dp_shard,
                cp=m.cp,
                tp=m.tp,
                ep=m.ep,
                etp=m.etp,
                edp=m.edp,
            ).validate(
                num_experts=args.moe.num_experts,
                moe_ffn_dim=args.moe.moe_ffn_dim,
                n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads,
                seq_len=seq_len,
            )
    # the model's sizes prune: 8 experts never allow ep 16; tp takes exactly the divisors of the kv heads
    got = enumerate_mappings(16, sizes, seq_len)
    assert {m.ep for m in got} == {1, 2, 4, 8}
    assert {m.tp for m in got} == {d for d in (1, 2, 4, 8, 16) if args.n_kv_heads % d == 0}


def test_folded_flag_and_legacy_groups():
    # legacy scheme: EP a subgroup of DP and expert TP == TP
    assert not Mapping(1, 1, 8, 1, 1, 8, 1, 1).folded
    assert Mapping(1, 1, 1, 8, 1, 8, 1, 1).folded  # cp 8 x ep 8 on 8 GPUs
    assert Mapping(1, 1, 4, 1, 2, 8, 1, 1).folded  # etp 1 != tp 2
    # cp 8, ep 8, 64 GPUs: titan_fold's EP groups are 8 consecutive ranks; the legacy order
    # (tp-cp-ep-dp-pp) strides them by cp and spreads each over 8 nodes
    m = Mapping(1, 1, 8, 8, 1, 8, 1, 8)
    assert group_membership(m)["ep"][0] == list(range(8))
    assert group_membership(m, legacy=True)["ep"][0] == list(range(0, 64, 8))
    assert group_membership(m, legacy=True)["edp"][0] == list(range(8))  # legacy expert DP = the cp ranks


def test_group_membership_is_the_trainers_meshes():
    """The planner's process-group-free meshes give the same groups as titan_fold.layout's real build."""
    if dist.is_initialized():  # a test before this one that left its group behind
        dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    try:
        for m in (Mapping(2, 2, 1, 2, 2, 4, 2, 1), Mapping(1, 1, 2, 4, 2, 2, 4, 2), Mapping(4, 1, 1, 1, 4, 1, 2, 2)):
            real = Layout(
                16,
                pp=m.pp,
                dp_replicate=m.dp_replicate,
                dp_shard=m.dp_shard,
                cp=m.cp,
                tp=m.tp,
                ep=m.ep,
                etp=m.etp,
                edp=m.edp,
            )
            real.build_mesh("cpu")
            ours = group_membership(m)
            for name in ("tp", "cp", "dp_shard_cp", "dp_replicate", "ep", "etp", "edp"):
                mesh = "expert" if name in ("ep", "etp", "edp") else "attention"
                assert ours[name] == real.groups(name, mesh), (m, name)
            assert ours["pp"] == real.groups("pp")
    finally:
        dist.destroy_process_group()


def test_memory_by_hand():
    # dim 8, 2 layers, 2 heads of 4 (1 kv head), vocab 16, 4 experts of 8 top-2, no shared expert
    args = TransformerArgs(
        dim=8,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        vocab_size=16,
        ffn_dim=16,
        moe=MoEArgs(num_experts=4, top_k=2, moe_ffn_dim=8),
    )
    sizes = model_sizes(args, 16)
    # per layer: wq 64 + wk 32 + wv 32 + wo 64 = 192 (TP); norms 16 + router 32 = 48; experts 3*4*8*8 = 768
    assert sizes.tp_params_per_layer["moe"] == 192 and sizes.rep_params_per_layer["moe"] == 48
    assert sizes.expert_params_per_layer == 768
    assert sizes.embedding_params == 128 and sizes.head_params == 136  # output 16*8 + final norm 8
    assert sizes.total_params == 2 * (192 + 48 + 768) + 128 + 136
    # the per-layer FLOP split adds up to the trainer's count
    assert sizes.flops_per_token == 2 * sizes.flops_per_token_layer["moe"] + sizes.flops_per_token_head

    # 2 GPUs: FSDP 2 for dense, ep 2 for experts; seq 16, 4 sequences -> 2 micro-batches per rank; fp32
    m = Mapping(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, etp=1, edp=1)
    mem = memory(sizes, m, Workload(seq_len=16, global_batch=4, compute_bytes=4))
    sharded = (2 * (192 + 48) + 128 + 136) / 2 + 2 * 768 / 2  # 372 dense + 768 experts
    assert mem.params == sharded * 4 and mem.grads == sharded * 4 and mem.optimizer == sharded * 8
    # biggest unit, the block without its experts (edp = 1: not FSDP units): 2 param copies +
    # grad, + fp32 grad; in fp32 the experts' own cast is no copy
    assert mem.unsharded == 192 * (3 * 4 + 4)
    # attention: 2 norms x 3 h-wide tensors, q (8) k v (4 each), out (8); fp32 log-sum-exp (2 heads), 2 x 1/rms
    attention = 4 * (6 * 8 * 16 + 16 * 16 + 16 * 8) + 4 * (16 * 2 + 2 * 16)
    # router input, fp32 logits, int64 top-2; 32 routed rows: 3 int64 indices + 2 for the
    # expert sort after the exchange, input (h), prob, 3 x ffn 8 (w1 and w3 outputs kept by the
    # fused SwiGLU x probability, w2's input)
    moe = 4 * 8 * 16 + 4 * 16 * 4 + 8 * 16 * 2 + 40 * 32 + 4 * 32 * (8 + 1 + 3 * 8)
    assert (attention, moe) == (4864, 6528)
    assert mem.activations == 2 * (attention + moe)
    assert mem.backward == attention + moe  # gradients of one block's tensors during its backward
    assert mem.dispatcher == 4 * 8 * (16 * 2 + 32)
    assert mem.logits == (4 + 4 + 4) * 16 * 16  # logits, log-softmax, gradient
    assert mem.total == 18240 + 3072 + 3 * (4864 + 6528) + 2048 + 3072 == 60608
    # dropless worst case: both EP ranks send all their copies for our 2 experts: 64 rows, not 32
    worst_moe = 4 * 8 * 16 + 4 * 16 * 4 + 8 * 16 * 2 + 40 * 64 + 4 * 64 * (8 + 1 + 3 * 8)
    assert mem.total_worst_dropless == 60608 - 3 * moe + 3 * worst_moe + 4 * 8 * 32
    # full recompute keeps the block inputs (2 x 16 x 8 x 4 bytes) plus one block being recomputed
    full = memory(sizes, Mapping(1, 1, 2, 1, 1, 2, 1, 1, "full"), Workload(16, 4, compute_bytes=4))
    assert full.activations == 2 * 16 * 8 * 4 + attention + moe


def test_paper_claim_cp8_ep8_needs_64_gpus_without_folding():
    sizes = model_sizes(FLAVORS["qwen2_moe"]["57B-A14B"], 4096)
    folded = min_gpus(sizes, 4096, {"cp": 8, "ep": 8}, folded=True)
    legacy = min_gpus(sizes, 4096, {"cp": 8, "ep": 8}, folded=False)
    assert folded[0] == 8 and legacy[0] == 64
    assert (folded[1].dp, legacy[1].dp) == (1, 8)


def test_paper_long_context_case_prefers_a_folded_mapping():
    """Mixtral-8x22B, 128 H100s, 16K tokens, global batch 1024 (the paper's Table 5, first row)."""
    sizes = model_sizes(FLAVORS["mixtral"]["8x22B"], 16384)
    result = plan(sizes, Workload(16384, 1024), Cluster(128), top=2)
    best = result.ranked[0]
    assert best.mapping.folded and best.fits
    assert not best.comm["ep"].crossing  # the EP all-to-all stays inside a node
    assert result.best_legacy is not None and not result.best_legacy.mapping.folded
    assert result.best_legacy.step_s > 1.05 * best.step_s
    # the ranking is exact for what it shows: re-estimating with real groups gives the same times
    again = estimate(sizes, best.mapping, Workload(16384, 1024), Cluster(128))
    assert again.step_s == best.step_s


@pytest.mark.slow
def test_cli_json_and_written_config_parse(tmp_path):
    cfg = tmp_path / "plan.toml"
    out = python_m(
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
        "--fix",
        "pp=1",
        "--format",
        "json",
        "--write-config",
        str(cfg),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert len(rep["ranked"]) == 3
    times = [e["step_s"] for e in rep["ranked"]]
    assert times == sorted(times) and all(e["fits"] for e in rep["ranked"])
    assert all(e["mapping"]["pp"] == 1 for e in rep["ranked"])  # --fix pp=1
    best = rep["ranked"][0]["mapping"]
    config = parse_args(["--job.config_file", str(cfg)])
    p = config.parallelism
    assert (
        p.pipeline_parallel_degree,
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
        p.expert_parallel_degree,
        p.expert_tensor_parallel_degree,
        p.expert_data_parallel_degree,
    ) == (
        best["pp"],
        best["dp_replicate"],
        best["dp_shard"],
        best["cp"],
        best["tp"],
        best["ep"],
        best["etp"],
        best["edp"],
    )
    assert (config.model.name, config.model.flavor) == ("qwen2_moe", "debug")
    assert (config.training.seq_len, config.training.global_batch_size) == (128, 16)
    assert config.activation_checkpoint.mode == best["recompute"]


def test_written_config_with_pipeline_and_capacity_parses(tmp_path):
    path = tmp_path / "pp.toml"
    path.write_text(
        job_toml(
            "mixtral", "8x22B", Mapping(8, 2, 1, 4, 2, 8, 1, 2, "selective"), Workload(16384, 1024, capacity_factor=1.0)
        )
    )
    config = parse_args(["--job.config_file", str(path)])
    assert config.parallelism.pipeline_parallel_degree == 8 and config.parallelism.context_parallel_degree == 4
    assert config.training.local_batch_size == 1024 // 2  # all of the rank's sequences, one per micro-batch
    assert config.moe.capacity_factor == 1.0 and config.activation_checkpoint.mode == "selective"


def test_activation_inventory_matches_autograd():
    """What the planner counts per block vs the bytes autograd saves in one more eager block (fp32)."""
    import dataclasses

    import torch

    from titan_fold.models import Transformer

    seq, batch = 256, 2

    def saved_bytes(n_layers):
        args = dataclasses.replace(FLAVORS["qwen2_moe"]["debug"], n_layers=n_layers)
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:  # weights saved for backward are not activations
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, args.vocab_size, (batch, seq)))
        return sum(seen.values()), args

    one, args = saved_bytes(1)
    two, _ = saved_bytes(2)
    planned = activation_bytes(
        model_sizes(args, seq), Mapping(1, 1, 1, 1, 1, 1, 1, 1), Workload(seq, batch, compute_bytes=4)
    )
    ratio = planned * batch / (two - one)
    assert 0.95 < ratio < 1.15, ratio


def test_two_gpu_trainer_measurements():
    """The planner against the latest measured 2-GPU trainer foldings (bench/results/2gpu_*.json,
    step `foldings`, paired by bench/planned.py; docs/planning.md quotes the table). A missing
    record fails.

    Memory: the estimate is never under the measured peak (max reserved) and at most 15% over
    it. The 2026-11-24 record (2 x H200, Qwen2-57B-A14B-L2) gives 1.096 to 1.143: the planner
    counts 4.3 to 5.4 GiB more than the allocator reserved, an excess the record's peak alone
    does not break down; 15% states that and fails on a larger drift either way.
    Step time: the expert foldings under one attention layout (the same tokens per step) rank
    as measured wherever their measured times differ by more than 1%; closer ones are ties (tp2's
    two foldings differ by 0.006%). The record holds one run per case in one call; dp2_ep2 alone
    spread 0.201-0.228 s over three calls (2gpu_h200x2_2026-11-26_04*), so dp2's 5.4% gap is an
    order within that one call. Across attention layouts the planner does not rank: its step is
    0.63x the measured under dp2 and 0.44x under tp2 (docs/planning.md), not checked here."""
    import re

    _, found = pairs(latest_record())
    assert found, "no folding of the record ran through"
    for p in found:
        # the planner's mapping and batch are what the case ran: its folding and its command's flags
        folding, words = p.row["folding"], p.row["command"]
        flags = dict(re.findall(r"--(\S+) (\S+)", words))
        assert (p.mapping.tp, p.mapping.ep, p.mapping.etp, p.mapping.edp) == (
            folding.get("tp", 1),
            folding["ep"],
            folding["etp"],
            folding["edp"],
        ), p.row["case"]
        assert p.mapping.pp * p.mapping.dp_shard * p.mapping.cp * p.mapping.tp == p.row["nproc"] == 2
        assert p.work.seq_len * p.work.global_batch == int(flags["training.seq_len"]) * int(
            flags["training.global_batch_size"]
        )
        ratio = p.estimate.memory.total / 2**30 / p.row["peak_memory_gib"]
        assert 1 <= ratio < 1.15, (p.row["case"], p.row["peak_memory_gib"], p.estimate.memory.gib())
    layouts = {}
    for p in found:
        layouts.setdefault((p.mapping.pp, p.mapping.dp_shard, p.mapping.cp, p.mapping.tp), []).append(p)
    ranked = 0
    for same in layouts.values():
        for a, b in itertools.combinations(same, 2):
            ta, tb = a.row["step_time_s"], b.row["step_time_s"]
            if abs(ta - tb) > 0.01 * min(ta, tb):
                ranked += 1
                assert (ta < tb) == (a.estimate.step_s < b.estimate.step_s), (
                    a.row["case"],
                    ta,
                    a.estimate.step_s,
                    b.row["case"],
                    tb,
                    b.estimate.step_s,
                )
    assert ranked, "no two foldings of one attention layout to rank"


def test_exchange_latency_per_exact_exchange():
    """Cluster.exchange_latency_s: four host waits per MoE layer and micro-batch where experts cross
    GPUs (ep x etp > 1), none where they do not."""
    sizes = model_sizes(FLAVORS["qwen3_moe"]["debug"], 256)
    work = Workload(256, 4)
    base, slow = Cluster(2, gpus_per_node=2), Cluster(2, gpus_per_node=2, exchange_latency_s=1e-3)
    folded, plain = Mapping(1, 1, 2, 1, 1, 2, 1, 1), Mapping(1, 1, 2, 1, 1, 1, 1, 2)
    waits = 4 * sizes.n_moe_layers * 1e-3 * work.microbatches(folded.dp)
    assert estimate(sizes, folded, work, slow).step_s - estimate(sizes, folded, work, base).step_s == pytest.approx(
        waits
    )
    assert estimate(sizes, plain, work, slow).step_s == estimate(sizes, plain, work, base).step_s


def test_calibrated_planner_predicts_two_gpu_foldings():
    """bench/calibrate.py on the 2 x H200 records of one lease: fitted on the one-GPU run and on
    dp2 x ep2, the planner predicts tp2 x ep2 (one global batch) and dp2 x etp2 within 15%.
    dp2 x edp2 is not predicted (docs/planning.md says why), so it is not checked."""
    from bench.calibrate import calibrate
    from bench.common import RESULTS_DIR

    records = [
        os.path.join(RESULTS_DIR, f"exchange_h200x2_2026-11-28_{name}.json")
        for name in ("1624_tp2_batch", "1638_foldings")
    ]
    cluster, rows = calibrate(records)
    ratio = {
        case.name.split("_bf16")[0] + ("_b4" if "_b4" in case.name else ""): fit / case.measured_s
        for case, _, fit in rows
    }
    assert ratio["1gpu"] == pytest.approx(1, abs=1e-3) and ratio["dp2_ep2"] == pytest.approx(1, abs=1e-3)
    assert 0 < cluster.exchange_latency_s < 0.01 and 0.1 < cluster.compute_efficiency < 0.6
    assert 0.85 <= ratio["tp2_ep2_b4"] <= 1.15 and 0.85 <= ratio["dp2_etp2"] <= 1.15, ratio
