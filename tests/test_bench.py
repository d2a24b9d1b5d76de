"""CPU checks of the benchmark logic: FLOP counts, the result schema, timing, summaries,
proxy flavors, and the tiny MoE-layer and row-movement benchmarks end to end (--smoke)."""

import dataclasses
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common, moe_layer, report, routing, row_movement, train_step, vs_torchtitan  # noqa: E402
from titan_fold.models import FLAVORS, Transformer  # noqa: E402
from titan_fold.moe import MoE, MoEArgs  # noqa: E402


def test_moe_layer_flops_match_parameter_count():
    # independent count: 6 FLOPs per activated weight per token, activated weights read off a real layer
    dim, ffn, E, k, shared = 48, 24, 8, 2, 40
    layer = MoE(dim, MoEArgs(num_experts=E, top_k=k, moe_ffn_dim=ffn, shared_ffn_dim=shared, shared_expert_gate=True))
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    active = n(layer.experts) * k / E + n(layer.shared_expert) + n(layer.router) + n(layer.shared_expert_gate)
    tokens = 1000
    f = common.moe_layer_flops(tokens, dim, ffn, k, E, shared, True)
    assert f["total"] == pytest.approx(6 * tokens * active)
    assert f["routed"] == pytest.approx(6 * tokens * n(layer.experts) * k / E)
    # token drop: only kept assignments run
    assert common.moe_layer_flops(tokens, dim, ffn, k, E, kept_frac=0.75)["routed"] == pytest.approx(0.75 * f["routed"])


def test_qwen2_shape_flops_by_hand():
    f = common.moe_layer_flops(8192, 3584, 2560, 8, 64, 20480, True)
    assert f["routed"] == 6 * 8192 * 8 * 3 * 3584 * 2560  # 10.82 TFLOP
    assert f["shared"] == 6 * 8192 * 3 * 3584 * 20480
    assert f["total"] == f["routed"] + f["shared"] + 6 * 8192 * 3584 * 64 + 6 * 8192 * 3584


def test_write_result_schema(tmp_path):
    path = common.write_result("x", {"a": 1.5, "nan": float("nan")}, str(tmp_path), command="python bench/x.py --y")
    with open(path) as f:
        rec = json.load(f)
    assert set(common.SCHEMA_KEYS) <= set(rec)
    assert rec["command"] == "python bench/x.py --y" and rec["figures"]["a"] == 1.5
    assert rec["figures"]["nan"] is None  # NaN is not JSON
    assert {"device", "torch", "cuda", "nccl"} <= set(rec["env"]) and rec["env"]["torch"] == torch.__version__


def test_command_line_reproduces_launch(monkeypatch):
    monkeypatch.delenv("BENCH_LAUNCHER", raising=False)
    assert common.command_line(["bench/a.py", "--x", "a b"]) == "python bench/a.py --x 'a b'"
    monkeypatch.setenv("BENCH_LAUNCHER", "torchrun --nproc_per_node 2")
    assert common.command_line(["bench/a.py"]) == "torchrun --nproc_per_node 2 bench/a.py"


def test_time_ms_counts_calls():
    calls = []
    times = common.time_ms(lambda: calls.append(1), warmup=2, iters=5, device=torch.device("cpu"))
    assert len(calls) == 7 and len(times) == 5 and all(t >= 0 for t in times)
    assert common.median([3.0, 1.0, 2.0]) == 2.0 and common.median([1.0, 2.0, 3.0, 4.0]) == 2.5


def test_dense_rate_sustained_and_copy_rate(monkeypatch):
    """seconds > 0: after the burst, as many timed products as fill the seconds asked at the
    burst's pace, and the rate is theirs (no warm-up: the burst was it). The copy rate counts
    the bytes read and written."""
    calls = []

    def fake_time_ms(fn, warmup, iters, device):
        fn()  # what would be timed runs
        calls.append((warmup, iters))
        return [4.0 if len(calls) == 1 else 5.0] * iters

    monkeypatch.setattr(common, "time_ms", fake_time_ms)
    n = 32
    assert common.dense_gemm_tflops(torch.device("cpu"), n=n) == pytest.approx(2 * n**3 / 4e-3 / 1e12)
    calls.clear()
    assert common.dense_gemm_tflops(torch.device("cpu"), n=n, seconds=1.5) == pytest.approx(2 * n**3 / 5e-3 / 1e12)
    assert calls == [(3, 10), (0, 375)]  # 1.5 s at 4 ms a product
    assert common.gpu_reading(torch.device("cpu")) == {"sm_clock_mhz": None, "power_w": None}  # nothing to read
    calls.clear()  # the copy rate: bytes read plus bytes written over the median time
    assert common.copy_tbps(torch.device("cpu"), nbytes=4096) == pytest.approx(2 * 4096 / 4e-3 / 1e12)
    assert calls == [(3, 20)]


def test_time_ms_times_without_automatic_gc():
    """The timed calls run with automatic garbage collection off (the warm-up with it on, as
    the caller had it), and the caller's setting comes back."""
    import gc

    seen = []
    common.time_ms(lambda: seen.append(gc.isenabled()), 1, 3, torch.device("cpu"))
    assert seen == [True, False, False, False]
    assert gc.isenabled()


def test_kernel_classes():
    assert moe_layer.kernel_class("ncclDevKernel_SendRecv") == "nccl"
    assert moe_layer.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert moe_layer.kernel_class("void cub::DeviceRadixSortOnesweepKernel") == "sort_scan"
    assert moe_layer.kernel_class("void at::native::index_elementwise_kernel") == "index_scatter_gather"
    assert moe_layer.kernel_class("void at::native::vectorized_elementwise_kernel<silu>") == "elementwise_other"


def test_idle_before_kernels_charges_each_gap_to_the_kernel_after_it():
    # us: a [0, 10], b [12, 20] (2 idle), c [15, 30] inside b's span (none), a [35, 40] (5), b [41, 50] (1)
    spans = [(0, 10, "a"), (12, 20, "b"), (15, 30, "c"), (35, 40, "a"), (41, 50, "b")]
    assert moe_layer.idle_before_kernels(spans, steps=1) == {"a": 0.005, "b": 0.003}
    # per step, the largest first, at most top
    assert moe_layer.idle_before_kernels(spans, steps=5, top=1) == {"a": 0.001}


def test_moe_layer_smoke(tmp_path):
    fig = moe_layer.main(["--smoke", "--out-dir", str(tmp_path)])
    rows = {r["mode"]: r for r in fig["rows"]}
    assert set(rows) == {"dropless", "cf1.0"} and not any("error" in r for r in rows.values())
    assert rows["dropless"]["kept_frac"] == 1.0 and 0 < rows["cf1.0"]["kept_frac"] <= 1.0
    for r in rows.values():
        # TFLOP/s is the FLOP count over the median time
        flops = r["gflop_per_step"]["total"] * 1e9
        assert r["tflops"] == pytest.approx(flops / (r["median_ms"] * 1e-3) / 1e12, rel=2e-2, abs=1e-3)
        parts = r["breakdown"]["forward_ms_by_part"]
        assert {"router", "dispatcher", "grouped_gemm", "permute_sort", "shared_expert"} <= set(parts)
        inner = sum(
            parts.get(k, 0.0)
            for k in (
                "grouped_gemm",
                "permute_sort",
                "count_exchange",
                "all_to_all",
                "all_gather_v",
                "reduce_scatter_v",
            )
        )
        assert parts["dispatcher_rest_gather_combine"] == pytest.approx(parts["dispatcher"] - inner, abs=2e-3)
    with open(tmp_path / "moe_layer.json") as f:
        assert json.load(f)["figures"]["rows"][0]["shape"] == "tiny"


def test_routing_smoke(tmp_path):
    # topk, the sort's head and the argmax passes chose alike, and every key width sorted alike (checked inside)
    # (the group-limited ways too: the tiny shape has groups), and route_whole ran forward and backward
    figures = routing.main(["--smoke", "--out-dir", str(tmp_path)])
    (row,), (route,) = figures["rows"], figures["routes"]
    assert {
        "choice_topk_us",
        "choice_sort_head_us",
        "choice_argmax_us",
        "grouped_choice_topk_us",
        "grouped_choice_argmax_us",
        "grouping_sort_uint8_us",
        "group_by_us",
    } <= set(row)
    assert route["route_compiled_us"] > 0 and route["route"]["num_groups"] == 4 and "route_triton_us" not in route
    assert json.load(open(tmp_path / "routing.json"))["figures"]["rows"][0]["experts"] == 8
    # the report's tables: a header, its rule and the one row, every key width timed; then the route
    # (no kernels counted and no Triton way on the CPU)
    lines = report.routing_table({"figures": {"routing": figures}})
    assert len(lines) == 7 and lines[2].startswith("| tiny | 8 | eager |") and " - " not in lines[2]
    assert lines[6].startswith("| tiny | score_func sigmoid, num_groups 4, group_topk 2 | - | - |")


def test_row_movement_smoke(tmp_path):
    """The three ways agree (checked inside against indexing) and each was timed."""
    (row,) = row_movement.main(["--smoke", "--out-dir", str(tmp_path)])["rows"]
    assert row["shape"] == "tiny" and all(
        row[f"{w}_ms"] > 0 for w in ("indexing", "embedding_bag", "gather_sum", "dispatcher")
    )
    assert json.load(open(tmp_path / "row_movement.json"))["figures"]["rows"][0]["top_k"] == 2


def test_log_flags(tmp_path):
    log = tmp_path / "case.log"
    log.write_text(
        "step 1\n"
        + "UserWarning: Mismatch dtype between input and weight: input dtype = float\n"
        + "[0/1] [__recompiles] Recompiling function forward in transformer.py:121\n" * 2
    )
    assert train_step.log_flags(str(log)) == {"dtype_mismatch_warnings": 1, "recompiles": 2}
    log.write_text("step 1\n")
    assert train_step.log_flags(str(log)) == {"dtype_mismatch_warnings": 0, "recompiles": 0}


def test_train_step_rebuild_reads_what_a_cut_run_left(tmp_path, capsys):
    """--rebuild: no training, the rows from the metrics and logs a cut-off run left (return code 'cut')."""
    case = "dp2_ep2_compiled"
    (tmp_path / case).mkdir()
    recs = [{"step": s, "loss": 10.0 - s, "tokens_per_sec": 100.0 * s, "max_memory_gib": 5.0} for s in range(1, 9)]
    (tmp_path / case / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / f"{case}.log").write_text("[0/1] [__recompiles] Recompiling function forward in x.py:1\n")
    # what the worker's counters wrote: the loop compiled into a graph
    (tmp_path / case / "expert_path.json").write_text(json.dumps({"calls": {}, "compiled": {"loop": 1}}))
    out = tmp_path / "out"
    figures = train_step.main(
        [
            "--cases",
            case,
            "--steps",
            "8",
            "--work-dir",
            str(tmp_path),
            "--rebuild",
            "--name",
            "cut",
            "--out-dir",
            str(out),
        ]
    )
    (row,) = figures["rows"]
    assert row["returncode"] == "cut" and row["steps_logged"] == 8 and row["steps_measured"] == 3
    assert row["tokens_per_sec_per_gpu"] == 700.0 and row["recompiles"] == 1 and "log_tail" in row
    assert row["expert_path_calls"] == {} and row["expert_path_compiled"] == {"loop": 1}
    assert "ran the per-expert loop" in capsys.readouterr().out
    assert json.load(open(out / "cut.json"))["figures"]["rows"][0]["case"] == case


def test_expert_path_counters_count_the_path_that_ran():
    """bench/train_step.py's counters on a real MoE layer, forward and backward on the CPU: float32
    rows take torch's grouped GEMM, float64 rows the per-expert loop, each counted per call; compiled
    (bf16 rows, torch's grouped GEMM) the path is counted once per graph, not per call; the
    counters come off afterwards. The report names each path counted, and marks a row that counted
    none (records from before the counters, all zeros) unknown."""
    from titan_fold.moe.experts import GroupedExperts

    choose = GroupedExperts.path
    torch.manual_seed(0)
    for dtype, want in ((torch.float32, "torch"), (torch.float64, "loop")):
        layer = MoE(32, MoEArgs(num_experts=4, top_k=2, moe_ffn_dim=16)).to(dtype)
        layer.init_weights(0.1)
        with train_step.counting_expert_paths() as paths:
            for _ in range(2):
                layer(torch.randn(2, 8, 32, dtype=dtype)).square().sum().backward()
        assert paths == {"calls": {want: 2}, "compiled": {}}, dtype
    layer = MoE(32, MoEArgs(num_experts=4, top_k=2, moe_ffn_dim=16)).to(torch.bfloat16)
    layer.init_weights(0.1)
    compiled = torch.compile(layer, backend="aot_eager")
    with train_step.counting_expert_paths() as paths:
        for _ in range(3):
            compiled(torch.randn(2, 8, 32, dtype=torch.bfloat16)).float().square().sum().backward()
    assert paths == {"calls": {}, "compiled": {"torch": 1}}
    assert GroupedExperts.path is choose
    assert (
        report.expert_path({"expert_path_calls": {"torch": 180, "loop": 0}, "expert_path_compiled": {}}) == "torch 180"
    )
    assert (
        report.expert_path({"expert_path_calls": {}, "expert_path_compiled": {"quack": 2, "loop": 1}})
        == "quack 2 graphs, loop 1 graph"
    )
    assert report.expert_path({"expert_path_calls": {"grouped_mm": 0, "loop": 0, "padded": 0}}) == "unknown"
    assert report.expert_path({"case": "1gpu"}) == "unknown"


def test_train_step_summary_and_plans():
    recs = [
        {
            "step": s,
            "loss": 10.0 - s,
            "tokens_per_sec": 100.0 * s,
            "mfu": float(s),
            "tflops": 1.0,
            "max_memory_gib": 5.0 + (s == 2),
            "time_per_step_s": 1.0 / s,
        }
        for s in range(1, 8)
    ]
    out = train_step.summarize(recs, warmup_steps=3)
    assert out["steps_measured"] == 4
    assert out["tokens_per_sec_per_gpu"] == 550.0  # median of 400..700
    assert out["mfu_pct"] == 5.5 and out["peak_memory_gib"] == 5.0  # step 2's peak is warm-up
    assert out["loss_first"] == 9.0 and out["loss_last"] == 3.0

    class A:
        family, proxy, seq_len, local_batch, steps, param_dtype = "qwen2_moe", "57B-A14B-L2", 4096, 2, 20, "bfloat16"
        lr_warmup_steps = 2

    nproc, args = train_step.case_plan("dp2_etp2", A)
    get = lambda k: args[args.index(k) + 1]  # noqa: E731
    assert nproc == 2 and get("--parallelism.expert_tensor_parallel_degree") == "2"
    assert get("--parallelism.expert_parallel_degree") == "1" and get("--training.global_batch_size") == "4"
    nproc, args = train_step.case_plan("1gpu_compiled", A)
    assert nproc == 1 and "--compile.enable" in args and get("--training.mixed_precision_param") == "bfloat16"
    assert get("--lr_scheduler.warmup_steps") == "2"
    A.lr_warmup_steps = 20
    nproc, args = train_step.case_plan("1gpu_compiled", A)
    assert get("--lr_scheduler.warmup_steps") == "20"
    nproc, args = train_step.case_plan("dp2_ep2_bf16params_b4_ga2", A)
    assert nproc == 2 and get("--training.local_batch_size") == "4" and get("--training.global_batch_size") == "16"
    assert get("--training.dtype") == "bfloat16" and "--compile.enable" not in args
    with pytest.raises(ValueError, match="unknown modifier 'fast'"):
        train_step.case_plan("dp2_ep2_fast", A)
    with pytest.raises(ValueError, match="must start with"):
        train_step.case_plan("dp4_ep2", A)
    _, args = train_step.case_plan("dp2_ep2_ga2_overlap_delaywgrad", A)
    assert get("--moe.ep_overlap") == "batch_wgrad"
    _, args = train_step.case_plan("dp2_ep2_ga2_delaywgrad", A)
    assert get("--moe.ep_overlap") == "wgrad"
    _, args = train_step.case_plan("dp2_ep2_ga2", A)
    assert "--moe.ep_overlap" not in args
    _, args = train_step.case_plan("dp2_ep2_compiled_static_stash4096", A)
    assert get("--moe.exchange") == "static" and get("--moe.stash_rows") == "4096"
    nproc, args = train_step.case_plan("cp2_ep2_docs", A)
    assert nproc == 2 and get("--training.document_masking") == "True"
    assert get("--parallelism.context_parallel_degree") == "2" and get("--parallelism.expert_parallel_degree") == "2"
    _, args = train_step.case_plan("dp2_ep2_compiled_skew_replicas16", A)
    assert get("--moe.hot_expert_replicas") == "16" and train_step.parse_case("dp2_ep2_skew")[1]["routing"] == "skew"
    assert "--metrics.expert_load" in train_step.case_plan("1gpu_expertload", A)[1]
    nproc, args = train_step.case_plan("pp2", A)
    assert nproc == 2 and get("--parallelism.pipeline_parallel_degree") == "2"
    assert get("--parallelism.data_parallel_shard_degree") == "1" and get("--training.global_batch_size") == "2"
    # every case's command passes the trainer's checks for its world size
    import bench.__main__ as bench_main
    from titan_fold.common.config import ConfigError, parse_args
    from titan_fold.models import FLAVORS
    from titan_fold.trainer.preflight import preflight

    train_step.register_proxy(A.family, A.proxy)
    try:
        for case in [
            *train_step.FOLDINGS,
            "1gpu_eager",
            "1gpu_bf16params_b4_eager",
            "dp2_ep2_b4_ga2",
            "dp2_ep2_bf16params_static_stash4096",
            "dp2_ep2_bf16params_compiled_static_cudagraphs",
            "1gpu_bf16params_auxfree_phases",
            "1gpu_docs",
            "cp2_ep2_docs",
            *bench_main.FOLDING_CASES.split(","),
            *bench_main.OPTION_CASES.split(","),
            *bench_main.MUON_CURVES.split(","),
            *bench_main.MUON_DP2_EP2.split(","),
            *bench_main.REPLICA_CASES.split(","),
            *bench_main.REPLICA_RUN.split(","),
        ]:
            nproc, args = train_step.case_plan(case, A)
            preflight(parse_args(args), nproc)
        # the static exchange is what lets CUDA graphs run over ep2: without it the trainer refuses
        with pytest.raises(ConfigError, match="moe.exchange = 'static'"):
            preflight(parse_args(train_step.case_plan("dp2_ep2_compiled_cudagraphs", A)[1]), 2)
    finally:
        FLAVORS[A.family].pop(A.proxy, None)


def test_train_step_phases_medians_and_table():
    """The case modifier `phases` turns metrics.step_phases on; the summary takes each phase's
    medians over the measured steps, and the report lists them per case (host / GPU ms)."""

    class A:
        family, proxy, seq_len, local_batch, steps, param_dtype = "qwen2_moe", "57B-A14B-L2", 4096, 2, 20, "bfloat16"
        lr_warmup_steps = 2

    assert "--metrics.step_phases" in train_step.case_plan("1gpu_bf16params_auxfree_phases", A)[1]
    assert "--metrics.step_phases" not in train_step.case_plan("1gpu_bf16params_auxfree", A)[1]
    # `rerun` names a second run of a configuration apart and changes none of its arguments
    assert train_step.case_plan("1gpu_bf16params_auxfree_compiled_torchgemm_rerun", A) == train_step.case_plan(
        "1gpu_bf16params_auxfree_compiled_torchgemm", A
    )
    recs = [
        {
            "step": s,
            "loss": 1.0,
            "tokens_per_sec": 1.0,
            "time_per_step_s": 1.0,
            "phases": {
                "forward": {"host_ms": 10.0 * s, "gpu_ms": 12.0 * s},
                "optimizer": {"host_ms": 1.0, "gpu_ms": 5.0},
            },
        }
        for s in range(1, 6)
    ]
    out = train_step.summarize(recs, warmup_steps=2)  # steps 3, 4, 5
    assert out["phases"] == {"forward": {"host_ms": 40.0, "gpu_ms": 48.0}, "optimizer": {"host_ms": 1.0, "gpu_ms": 5.0}}
    assert "phases" not in train_step.summarize([{k: v for k, v in r.items() if k != "phases"} for r in recs], 2)
    rec = {
        "figures": {"q": {"rows": [{"case": "1gpu_phases", **out}, {"case": "1gpu", "tokens_per_sec_per_gpu": 1.0}]}}
    }
    lines = report.train_phases_table(rec)
    assert lines[0] == "| step | case | forward host / GPU ms | optimizer host / GPU ms |"
    assert lines[2:] == ["| q | 1gpu_phases | 40.0 / 48.0 | 1.0 / 5.0 |"]


def test_proxy_flavor_keeps_widths():
    try:
        train_step.register_proxy("qwen2_moe", "57B-A14B-L2")
        base, proxy = FLAVORS["qwen2_moe"]["57B-A14B"], FLAVORS["qwen2_moe"]["57B-A14B-L2"]
        assert proxy.n_layers == 2 and proxy.vocab_size == 32768 and base.n_layers == 28
        assert dataclasses.replace(proxy, n_layers=base.n_layers, vocab_size=base.vocab_size) == base
    finally:
        FLAVORS["qwen2_moe"].pop("57B-A14B-L2", None)


def test_torchtitan_proxy_has_our_widths():
    """torchtitan's qwen3 proxy and ours: the same routed and shared expert weights per layer;
    attention differs only by Qwen3's q/k norms and Qwen2's qkv biases."""
    from torchtitan.models.qwen3 import Qwen3Model

    try:
        train_step.register_proxy("qwen2_moe", "57B-A14B-L2")
        ours_args = FLAVORS["qwen2_moe"]["57B-A14B-L2"]
        with torch.device("meta"):
            ours = Transformer(ours_args)
            theirs = Qwen3Model(vs_torchtitan.qwen3_args("qwen2_moe", "57B-A14B-L2", 4096))
        count = lambda m, key: sum(p.numel() for n, p in m.named_parameters() if key in n)  # noqa: E731
        assert count(ours, ".moe.experts.") == count(theirs, ".moe.experts.") == 2 * 64 * 3 * 3584 * 2560
        assert count(ours, ".moe.shared_expert.") == count(theirs, ".moe.shared_experts.") == 2 * 3 * 3584 * 20480
        assert count(ours, "tok_embeddings") == count(theirs, "tok_embeddings") == 32768 * 3584
        fpt = vs_torchtitan.our_flops_per_token("qwen2_moe", "57B-A14B-L2", 4096)
        assert fpt == ours_args.get_nparams_and_flops(ours, 4096)[1]
    finally:
        FLAVORS["qwen2_moe"].pop("57B-A14B-L2", None)


@pytest.mark.parametrize("base", ["30B-A3B", "57B-A14B"])
def test_torchtitan_qwen3_is_our_qwen3(base):
    """With the qwen3_moe family both trainers build the same model: every parameter of
    torchtitan's Qwen3 has one of ours of the same shape (its experts' w1 and w3 [E, ffn, dim]
    together our w13 [E, 2 * ffn, dim]), and none is left over."""
    from torchtitan.models.qwen3 import Qwen3Model

    proxy = f"{base}-L2"
    try:
        with torch.device("meta"):
            theirs = Qwen3Model(vs_torchtitan.qwen3_args("qwen3_moe", proxy, 4096))
            ours = Transformer(FLAVORS["qwen3_moe"][proxy])

        def theirs_stacked(name, p):
            if name.endswith("experts.w3"):
                return None
            return (p.shape[0], 2 * p.shape[1], p.shape[2]) if name.endswith("experts.w1") else tuple(p.shape)

        stacked = [s for n, p in theirs.named_parameters() if (s := theirs_stacked(n, p)) is not None]
        assert sorted(stacked) == sorted(tuple(p.shape) for p in ours.parameters())
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
        assert FLAVORS["qwen3_moe"][proxy].qk_norm and not FLAVORS["qwen3_moe"][proxy].moe.shared_expert_gate
    finally:
        FLAVORS["qwen3_moe"].pop(proxy, None)
        if base == "57B-A14B":
            FLAVORS["qwen3_moe"].pop(base, None)


class _HistcInFloat(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.histc and not args[0].is_floating_point():
            return torch.histc(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_torchtitan_side_two_steps_at_the_debug_size(tmp_path, family):
    """The torchtitan side of bench/vs_torchtitan.py as its worker's Trainer builds it, short of
    the GPU its Trainer requires: the case's own command-line keys parsed by torchtitan's
    ConfigManager, the registered TrainSpec's tokenizer and dataloader (titan_fold's, given
    torchtitan's config), its Qwen3 MoE or DeepSeek-V3 at our debug widths, its loss, two AdamW steps. The loss
    is finite and the second step's batch is the next slice of the token stream. Its router
    counts tokens with torch.histc on int64, which only CUDA implements: here a function mode
    counts them in float32 (exact below 2**24 tokens), and the experts take its for-loop path."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    proxy = "debug-L2"
    a = vs_torchtitan.parser().parse_args(
        ["--family", family, "--proxy", proxy, "--seq-len", "64", "--steps", "2", "--work-dir", str(tmp_path)]
    )
    try:
        nproc, keys = vs_torchtitan.torchtitan_args("1gpu_eager_b2", a)
        vs_torchtitan.register(a.family, a.proxy, a.seq_len)
        config = ConfigManager().parse_args(keys)
        spec = get_train_spec(vs_torchtitan.spec_name(family, proxy))
        tokenizer = spec.build_tokenizer_fn(config)
        loader = spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, job_config=config)
        model_args = spec.model_args[proxy]
        model_args.update_from_config(config)
        model_args.moe_args.use_grouped_mm = False  # its grouped GEMM path pads rows with a Triton kernel
        torch.manual_seed(0)
        model = spec.model_cls(model_args)
        with torch.no_grad():  # as its Trainer initialises
            model.init_weights(buffer_device=torch.device("cpu"))
        loss_fn = spec.build_loss_fn(config)
        opt = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr)
        batches, losses = iter(loader), []
        inputs = []
        for _ in range(config.training.steps):
            batch, labels = next(batches)
            assert batch["input"].shape == labels.shape == (2, 64)
            inputs.append(batch["input"])
            with _HistcInFloat():
                loss = loss_fn(model(batch["input"]), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        FLAVORS[family].pop(proxy, None)
    assert nproc == 1 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(inputs[0], inputs[1])


def test_torchtitan_deepseek_v3_has_our_widths():
    """torchtitan's deepseek_v3 at the 16B proxy's widths and ours: the same parameter count,
    expert and shared-expert widths and layer kinds (its wkv_a is our wkv_a and wk_rope fused)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    try:
        args = vs_torchtitan.deepseek_v3_args("16B-L4", 4096)
        args.moe_impl = "standard"  # what its update_from_config sets in the trainer
        with torch.device("meta"):
            theirs = DeepSeekV3Model(args)
            ours = Transformer(FLAVORS["deepseek_v3"]["16B-L4"])
        count = lambda m, key: sum(p.numel() for n, p in m.named_parameters() if key in n)  # noqa: E731
        assert count(ours, "") == count(theirs, "")
        assert count(ours, ".moe.experts.") == count(theirs, ".moe.experts.") == 3 * 64 * 3 * 2048 * 1408
        assert count(ours, ".moe.shared_expert.") == count(theirs, ".moe.shared_experts.") == 3 * 3 * 2048 * 2816
        assert count(ours, "attention.wkv_a") + count(ours, "attention.wk_rope") == count(theirs, "attention.wkv_a")
        assert [b.moe_enabled for b in ours.layers.values()] == [b.moe_enabled for b in theirs.layers.values()]
    finally:
        FLAVORS["deepseek_v3"].pop("16B-L4", None)


def test_flop_counts_differ_by_attention_counted_non_causal():
    """bench/report.py's two FLOP counts per token for the Qwen3-30B-A3B and DeepSeek-V3 proxies:
    on the same model (the widths tests above), torchtitan's exceeds titan_fold's by the causal
    attention term once more, 6 * n_layers * n_heads * seq_len * head_dim (the mean of the q.k and
    v widths with MLA; torchtitan counts every query against every key); its Qwen3-30B-A3B proxy's
    count is 21.2% higher. Computing them leaves the registered flavors as they were."""
    before = {family: dict(flavors) for family, flavors in FLAVORS.items()}
    seq = 4096
    ours, theirs = report.flop_counts("qwen3_moe", "30B-A3B-L12", seq)
    args = FLAVORS["qwen3_moe"]["30B-A3B"]
    assert theirs - ours == 6 * 12 * args.n_heads * seq * args.head_dim
    assert f"{100 * (theirs / ours - 1):.1f}" == "21.2"
    ours, theirs = report.flop_counts("deepseek_v3", "16B-L4", seq)
    args = FLAVORS["deepseek_v3"]["16B"]
    widths = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    assert theirs - ours == 6 * 4 * args.n_heads * seq * widths // 2
    assert {family: dict(flavors) for family, flavors in FLAVORS.items()} == before


def test_report_shows_both_mfu_counts(tmp_path):
    """The proxies' FLOP counts table, the trainer table's MFU in both counts and, beside
    torchtitan, each trainer's MFU in both: the one it logged, the other by the counts' ratio.
    The Qwen3-30B-A3B proxy at seq 4096: titan_fold's count 5,706,676,224 FLOPs per token (the
    GPU runs' records: titan_fold_flops_per_token), torchtitan's 6 * 12 * 32 * 4096 * 128 =
    1,207,959,552 more, 1.2117x: 30% MFU in ours is 36.35% in theirs, 20% in theirs 16.51% in ours."""
    proxy = {"family": "qwen3_moe", "seq_len": 4096}
    ours = {
        "case": "1gpu",
        "nproc": 1,
        "returncode": 0,
        "tokens_per_sec_per_gpu": 50000.0,
        "tflops_per_gpu": 1.0,
        "mfu_pct": 30.0,
        "peak_memory_gib": 1.0,
        "step_time_s": 0.1,
        "loss_first": 1.0,
        "loss_last": 1.0,
    }
    theirs = {
        "case": "1gpu",
        "returncode": 0,
        "tokens_per_sec_per_gpu": 33000.0,
        "mfu_pct": 20.0,
        "titan_fold_tokens_per_sec": 50000.0,
        "titan_fold_mfu_pct": 30.0,
        "ratio_titan_fold_over_torchtitan": 1.5,
    }
    _suite_file(
        tmp_path,
        "vs-torchtitan",
        {
            "q": {**proxy, "proxy_flavor": "30B-A3B-L12", "rows": [ours]},
            "torchtitan_q": {
                **proxy,
                "titan_fold_proxy": "30B-A3B-L12",
                "titan_fold_flops_per_token": 5706676224,
                "rows": [theirs],
            },
        },
    )
    text = report.report(str(tmp_path))
    assert "| qwen3_moe | 30B-A3B-L12 | 4096 | 5.707 | 6.915 | +21.2% |" in text
    assert "| q | 1gpu | 1 | single | - | unknown | 50,000 | 1.0 | 30.0 | 36.4 | 1.0 |" in text
    assert "| torchtitan_q | 1gpu | 33,000 | 50,000 | 1.500 | 20.0 | 16.5 | 30.0 | 36.4 |" in text


def _suite_file(tmp_path, suite, figures, date="2026-11-25T10:00:00Z", device="NVIDIA H100 80GB HBM3"):
    env = {"device": device, "device_count": 1, "torch": "2.11.0"}
    rec = {"suite": suite, "command": f"python -m bench {suite}", "date_utc": date, "env": env, "figures": figures}
    (tmp_path / f"{suite}_{device.split()[1].lower()}_{date[:10]}.json").write_text(json.dumps(rec))


def test_report_tables(tmp_path):
    assert report.report(str(tmp_path)) == ""  # no results, no tables
    row = {
        "case": "dp2_ep2",
        "nproc": 2,
        "returncode": 0,
        "folding": {"ep": 2, "etp": 1, "edp": 1},
        "tokens_per_sec_per_gpu": 44141.3,
        "tflops_per_gpu": 287.8,
        "mfu_pct": 29.1,
        "peak_memory_gib": 59.0,
        "step_time_s": 0.186,
        "loss_first": 10.9,
        "loss_last": 2.6,
    }
    _suite_file(tmp_path, "trainer", {"foldings": {"rows": [row]}}, date="2026-11-24T10:00:00Z")
    _suite_file(tmp_path, "trainer", {"foldings": {"rows": [dict(row, mfu_pct=30.0)]}})  # the latest wins
    layer = {
        "impl": "titan_fold_quack",
        "shape": "qwen3_30b_a3b",
        "mode": "dropless",
        "dispatch": "none",
        "compiled": "graph",
        "median_ms": 4.59,
        "tflops": 407.2,
        "ratio_to_dense_gemm": 0.509,
        "ratio_to_dense_sustained": 0.531,
    }
    base = dict(layer, median_ms=5.242)
    _suite_file(
        tmp_path,
        "layer",
        {
            "layer_fine": {"dense_bf16_gemm_tflops": 799.2, "dense_bf16_gemm_tflops_sustained": 766.8, "rows": [layer]},
            "layer_fine@base": {"dense_bf16_gemm_tflops": 799.6, "rows": [base]},
        },
    )
    text = report.report(str(tmp_path))
    assert (
        "| foldings | dp2_ep2 | 2 | dp2 FSDP | 2, 1, 1 | unknown | 44,141 | 287.8 | 30.0 | n/a | 59.0 | 0.186 | "
        "10.90 -> 2.60 |"
    ) in text  # no proxy recorded: torchtitan's count unknown
    assert "29.1" not in text
    assert (
        "| layer_fine | qwen3_30b_a3b | none | quack | graph | 4.59 | 407.2 | 799.2 | 0.509 | 766.8 | 0.531 | 5.24 "
        "| 1.142 |"
    ) in text
    del layer["ratio_to_dense_sustained"]  # a record made without the sustained rate
    _suite_file(tmp_path, "layer", {"layer_fine": {"dense_bf16_gemm_tflops": 799.2, "rows": [layer]}})
    text = report.report(str(tmp_path))  # its table as before: no sustained columns
    assert "| dense GEMM TFLOP/s | share of dense | code before: ms | before / after |" in text
    assert "| layer_fine | qwen3_30b_a3b | none | quack | graph | 4.59 | 407.2 | 799.2 | 0.509 | - | - |" in text
    _suite_file(
        tmp_path,
        "layer",
        {
            "layer_fine": {"dense_bf16_gemm_tflops": 799.2, "dense_bf16_gemm_tflops_sustained": 766.8, "rows": [layer]},
            "layer_fine@base": {"dense_bf16_gemm_tflops": 799.6, "rows": [base]},
        },
    )
    clocked = dict(layer, sm_clock_mhz=1485, power_w=695.2)  # a record with NVML's readings: the clock column
    _suite_file(
        tmp_path,
        "layer",
        {
            "layer_fine": {
                "dense_bf16_gemm_tflops": 799.2,
                "dense_sm_clock_mhz": {"burst": 1980, "sustained": 1530},
                "rows": [clocked, dict(clocked, error="out of memory")],
            }
        },
    )
    text = report.report(str(tmp_path))
    assert "| share of dense | SM clock MHz: dense burst, sustained, row | code before: ms |" in text
    assert "| 4.59 | 407.2 | 799.2 | 0.509 | 1,980 / 1,530 / 1,485 | - | - |" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| layer_fine |") or ln.startswith("| step | shape |")]
    assert "error: out of memory" in table[-1]
    assert {ln.count("|") for ln in table} == {13}  # 12 cells in each line: the header's
    assert text.index("Suite `layer`") < text.index("Suite `trainer`")
    assert "one profiled step" not in text  # no profiled row, no breakdown table
    # the host gaps are measured against the same case's step without the profiler, in the same run
    profiled = dict(
        row,
        case="1gpu_compiled_profile",
        trace_summary={
            "step_wall_ms": 250.0,
            "gpu_busy_ms": 180.0,
            "kernel_ms_by_class": {"optimizer": 58.0, "attention": 22.5},
        },
    )
    plain = dict(row, case="1gpu_compiled", step_time_s=0.2)
    _suite_file(tmp_path, "trainer", {"foldings": {"rows": [plain, profiled]}}, date="2026-11-25T11:00:00Z")
    text = report.report(str(tmp_path))
    assert (
        "| step | case | traced step ms | step ms without profiler | GPU busy ms | host gaps, share of step | "
        "optimizer | attention |"
    ) in text
    assert "| foldings | 1gpu_compiled_profile | 250.0 | 200.0 | 180.0 | 10.0% | 58.0 | 22.5 |" in text
    profiled["trace_summary"]["earlier_step_ms"] = 24.0  # the step before's kernels, in a column of their own
    _suite_file(tmp_path, "trainer", {"foldings": {"rows": [plain, profiled]}}, date="2026-11-25T11:00:00Z")
    text = report.report(str(tmp_path))
    assert "| GPU busy ms | host gaps, share of step | step before's kernels ms | optimizer | attention |" in text
    assert "| foldings | 1gpu_compiled_profile | 250.0 | 200.0 | 180.0 | 10.0% | 24.0 | 58.0 | 22.5 |" in text
    profiled["trace_summary"]["idle"] = {"idle_ms": 3.855, "waits": 36, "longest": []}  # and the GPU's waits
    _suite_file(tmp_path, "trainer", {"foldings": {"rows": [plain, profiled]}}, date="2026-11-25T11:00:00Z")
    text = report.report(str(tmp_path))
    assert "| step before's kernels ms | GPU idle ms (waits) | optimizer | attention |" in text
    assert (
        "| foldings | 1gpu_compiled_profile | 250.0 | 200.0 | 180.0 | 10.0% | 24.0 | 3.85 (36) | 58.0 | 22.5 |" in text
    )
    assert "Command: `python -m bench layer`" in text


def test_report_goals_latest_and_best_per_gpu(tmp_path):
    """Each goal's figure on each kind of one-GPU machine: the latest record's and the best recorded,
    each against the goal; the code before (<step>@base) and rows of other shapes, GEMM paths or
    machines left out."""

    def train(case, mfu):
        return {"case": case, "mfu_pct": mfu}

    eager, compiled = "1gpu_bf16params_auxfree", "1gpu_bf16params_auxfree_compiled"
    _suite_file(
        tmp_path,
        "trainer",
        {
            "qwen3_30b_a3b_l12": {"rows": [train(eager, 31.0), train(compiled, 36.1)]},
            "qwen3_30b_a3b_l12@base": {"rows": [train(compiled, 40.0)]},
        },
        date="2026-11-24T10:00:00Z",
    )
    theirs = [
        dict(train(eager, 22.0), ratio_titan_fold_over_torchtitan=1.84),
        dict(train(compiled, 24.0), ratio_titan_fold_over_torchtitan=1.5),
    ]
    _suite_file(
        tmp_path,
        "vs-torchtitan",
        {
            "qwen3_30b_a3b_l12": {"rows": [train(eager, 33.3), train(compiled, 34.4)]},
            "torchtitan_qwen3_30b_a3b_l12": {"titan_fold_proxy": "30B-A3B-L12", "rows": theirs},
        },
        date="2026-11-25T10:00:00Z",
    )

    def layer(impl, shape, mode, ms, share):
        return {
            "impl": impl,
            "shape": shape,
            "mode": "dropless",
            "dispatch": "none",
            "compiled": mode,
            "median_ms": ms,
            "ratio_to_dense_gemm": share,
        }

    rows = [
        layer("titan_fold_quack", "qwen3_30b_a3b", False, 4.6, 0.52),
        layer("titan_fold_quack", "qwen3_30b_a3b", "graph", 4.1, 0.58),
        layer("titan_fold", "qwen3_30b_a3b", "graph", 4.7, 0.61),  # torch's GEMMs: not the goal's
        layer("titan_fold_quack", "qwen2_57b_a14b", False, 9.9, 0.8),
        layer("titan_fold", "qwen2_57b_a14b", False, 10.0, 0.79),
        layer("titan_fold_quack", "qwen2_57b_a14b", True, 10.2, 0.78),
        layer("titan_fold", "qwen2_57b_a14b", True, 10.0, 0.79),
    ]
    _suite_file(
        tmp_path,
        "layer",
        {
            "layer_fine": {"rows": rows},
            "layer_fine@base": {"rows": [layer("titan_fold_quack", "qwen3_30b_a3b", "graph", 3.0, 0.7)]},
        },
        device="NVIDIA H200",
    )
    lines = report.goals_table(report.records(str(tmp_path)))
    assert lines[0] == "| goal | at least | GPU | latest | run | met | best | run | met |"
    h100 = "NVIDIA H100 80GB HBM3"
    assert (
        f"| Qwen3-30B-A3B proxy, eager: MFU % (titan_fold's count) | 30.0 | {h100} | 33.3 | 2026-11-25T10:00 | yes | 33.3 | 2026-11-25T10:00 | yes |"
        in lines
    )
    assert (
        f"| Qwen3-30B-A3B proxy, compiled: MFU % (titan_fold's count) | 35.0 | {h100} | 34.4 | 2026-11-25T10:00 | no | 36.1 | 2026-11-24T10:00 | yes |"
        in lines
    )
    assert (
        f"| Qwen3-30B-A3B proxy, compiled: tokens/s over torchtitan 0.2.2's | 1.600 | {h100} | 1.500 | 2026-11-25T10:00 | "
        "no | 1.500 | 2026-11-25T10:00 | no |"
    ) in lines
    assert (
        "| MoE layer at Qwen3-30B-A3B shapes, QuACK's GEMMs, best mode: share of dense | 0.600 | NVIDIA H200 | 0.580 | "
        "2026-11-25T10:00 | no | 0.580 | 2026-11-25T10:00 | no |"
    ) in lines
    # eager 10.0 / 9.9 ms, compiled 10.0 / 10.2: the slower mode's ratio
    assert (
        "| MoE layer at Qwen2-57B-A14B shapes: time with torch's GEMMs over QuACK's | 0.990 | NVIDIA H200 | 0.980 | "
        "2026-11-25T10:00 | no |"
    ) in "\n".join(lines)
    assert len(lines) == 2 + 6  # two MFU goals and two torchtitan ones on the H100, two layer goals on the H200


def test_layer_breakdown_table_shows_eager_and_captured_steps():
    """A profiled eager step and a profiled graph replay, each with its mode; the GPU's idle time
    between kernels where recorded (n/a in records made before it was)."""
    layer = {
        "impl": "titan_fold_quack",
        "shape": "qwen3_30b_a3b",
        "mode": "dropless",
        "dispatch": "none",
        "median_ms": 4.0,
        "ratio_to_dense_gemm": 0.55,
    }
    breakdown = {
        "step_gpu_ms_by_kernel_class": {"gemm": 3.0, "sort_scan": 0.05},
        "step_gpu_busy_ms": 3.2,
        "kernels_per_step": 83.0,
    }
    rows = [
        dict(layer, compiled=False, breakdown=breakdown),
        dict(
            layer,
            compiled="graph",
            median_ms=3.6,
            breakdown=dict(breakdown, step_gpu_span_ms=3.5, step_gpu_idle_ms=0.3),
        ),
    ]
    table = report.layer_breakdown_table({"figures": {"layer_profile": {"rows": rows}}})
    assert table[0].startswith(
        "| step | shape | moe.grouped_gemm | mode | step ms | GPU busy ms | step beyond GPU "
        "busy, share of step | GPU idle between kernels ms | kernels | gemm |"
    )
    assert table[2].startswith(
        "| layer_profile | qwen3_30b_a3b | quack | eager | 4.00 | 3.20 | 20.0% | n/a | 83 | 3.00 |"
    )
    assert table[3].startswith(
        "| layer_profile | qwen3_30b_a3b | quack | graph | 3.60 | 3.20 | 11.1% | 0.300 | 83 | 3.00 |"
    )


def test_report_partial_run_leaves_the_other_cases_shown(tmp_path):
    """A run of some of a step's trainer cases (--cases) is shown above the run holding the other
    cases' latest figures; a run of all of them hides the older one."""

    def row(case, tps):
        return {
            "case": case,
            "nproc": 1,
            "returncode": 0,
            "folding": {"ep": 1, "etp": 1, "edp": 1},
            "tokens_per_sec_per_gpu": tps,
            "tflops_per_gpu": 1.0,
            "mfu_pct": 1.0,
            "peak_memory_gib": 1.0,
            "step_time_s": 0.1,
            "loss_first": 1.0,
            "loss_last": 1.0,
        }

    _suite_file(
        tmp_path,
        "trainer",
        {"q": {"rows": [row("1gpu", 11111), row("1gpu_compiled", 22222)]}},
        date="2026-11-24T10:00:00Z",
    )
    _suite_file(tmp_path, "trainer", {"q": {"rows": [row("1gpu_compiled", 33333)]}}, date="2026-11-25T10:00:00Z")
    text = report.report(str(tmp_path))
    assert text.count("### Suite `trainer`") == 2 and text.index("33,333 |") < text.index("11,111 |")
    _suite_file(
        tmp_path,
        "trainer",
        {"q": {"rows": [row("1gpu", 44444), row("1gpu_compiled", 33333)]}},
        date="2026-11-25T10:00:00Z",
    )
    text = report.report(str(tmp_path))
    assert text.count("### Suite `trainer`") == 1 and "44,444 |" in text and "11,111 |" not in text


def test_report_vs_torchtitan_without_titan_folds_rows(tmp_path):
    """A vs-torchtitan record whose titan_fold step left no figures (cut by its time limit):
    torchtitan's rows are shown beside n/a, not taken for titan_fold's; a record the report
    cannot read leaves docs/benchmarks.md as it was."""
    row = {
        "case": "1gpu_bf16params_auxfree",
        "returncode": 0,
        "tokens_per_sec_per_gpu": 28174.6,
        "mfu_pct": 19.7,
        "tflops_per_gpu": 195.0,
        "peak_memory_gib": 71.0,
        "step_time_s": 0.29,
        "loss_first": 10.9,
        "loss_last": 4.9,
    }
    _suite_file(
        tmp_path,
        "vs-torchtitan",
        {"qwen3_30b_a3b_l12": None, "torchtitan_qwen3_30b_a3b_l12": {"titan_fold_proxy": "30B-A3B-L12", "rows": [row]}},
    )
    text = report.report(str(tmp_path))
    assert (
        "| torchtitan_qwen3_30b_a3b_l12 | 1gpu_bf16params_auxfree | 28,175 | n/a | n/a | 19.7 | n/a | n/a | n/a |"
        in text
    )
    assert "Trainer:" not in text

    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{report.BEGIN}\nold tables\n{report.END}\nafter\n")
    _suite_file(tmp_path, "trainer", {"broken": {"rows": [{"case": "x", "tokens_per_sec_per_gpu": 1.0}]}})  # no nproc
    with pytest.raises(KeyError):
        report.write_doc(str(tmp_path), str(doc))
    assert doc.read_text() == f"before\n{report.BEGIN}\nold tables\n{report.END}\nafter\n"


def test_report_rerun_beside_the_run_before(tmp_path):
    """Each step's latest run beside its run before on the same kind of machine: the figures both
    have (a layer row's share of the dense rate, GPU busy time, the dense rate), their ratio,
    whether it lies within 3%, and whether both medians were steady (within 5% of their fastest
    repeat); rows only one run has, and the code before (<step>@base), are left out."""

    def row(shape, ms, share, fastest=None):
        return {
            "impl": "titan_fold",
            "shape": shape,
            "mode": "dropless",
            "dispatch": "none",
            "compiled": "graph",
            "median_ms": ms,
            "min_ms": fastest or ms,
            "tflops": 1.0,
            "ratio_to_dense_gemm": share,
        }

    _suite_file(
        tmp_path,
        "layer",
        {
            "layer_fine": {
                "dense_bf16_gemm_tflops": 800.0,
                "copy_tbps": 3.1,
                "rows": [row("a", 5.0, 0.5), row("b", 20.0, 0.7), row("gone", 1.0, 0.1)],
            },
            "layer_fine@base": {"rows": [row("a", 9.0, 0.3)]},
        },
        date="2026-11-25T08:00:00Z",
    )
    (tmp_path / "layer_h100_2026-11-25.json").rename(tmp_path / "layer_h100_2026-11-25_0800.json")
    _suite_file(
        tmp_path,
        "layer",
        {
            "layer_fine": {
                "dense_bf16_gemm_tflops": 792.0,
                "copy_tbps": 3.0,
                "rows": [row("a", 5.1, 0.51), row("b", 21.0, 0.6, fastest=19.0), row("new", 2.0, 0.2)],
            },
            "layer_profile": {
                "dense_bf16_gemm_tflops": 790.0,
                "rows": [
                    dict(row("a", 7.0, 0.4), breakdown={"step_gpu_busy_ms": 5.0, "step_gpu_ms_by_kernel_class": {}})
                ],
            },
        },
        date="2026-11-25T09:00:00Z",
    )
    text = report.report(str(tmp_path))
    assert (
        "| layer_fine | a, none, torch, graph | share of dense | 2026-11-25T08:00 | 2026-11-25T09:00 | 0.500 | "
        "0.510 | 1.020 | yes | yes |"
    ) in text
    assert (
        "| layer_fine | b, none, torch, graph | share of dense | 2026-11-25T08:00 | 2026-11-25T09:00 | 0.700 | "
        "0.600 | 0.857 | no | no |" in text
    )  # 21 ms against a fastest repeat of 19: not steady
    assert (
        "| layer_fine | - | dense GEMM TFLOP/s | 2026-11-25T08:00 | 2026-11-25T09:00 | 800.00 | 792.00 | 0.990 | yes | yes |"
        in text
    )
    assert (
        "| layer_fine | - | copy TB/s | 2026-11-25T08:00 | 2026-11-25T09:00 | 3.100 | 3.000 | 0.968 | no | yes |"
        in text
    )
    reruns = text[text.index("Each step's latest run beside its run before") :]
    assert "gone" not in reruns and "new, none" not in reruns and "0.300" not in reruns
    assert (
        "2 of 4 figures within 3% of the run before; of the 3 steady ones" in text
        and "ones (both medians within 5% of their fastest repeat), 2." in text
    )
    # the earlier record holds a row no later one has (shape gone): it stays shown, for that row
    assert text.count("Suite `layer`") == 2 and "| layer_fine | gone | none | torch | graph |" in text
    (tmp_path / "layer_h100_2026-11-25_0800.json").unlink()
    (tmp_path / "layer_h100_2026-11-25.json").rename(tmp_path / "layer_h100_2026-11-25_0900.json")
    _suite_file(
        tmp_path,
        "layer",
        {
            "layer_fine": {"dense_bf16_gemm_tflops": 800.0, "rows": [row("a", 5.0, 0.5), row("b", 20.0, 0.7)]},
            "layer_fine@base": {"rows": [row("a", 9.0, 0.3)]},
        },
        date="2026-11-25T08:00:00Z",
    )
    (tmp_path / "layer_h100_2026-11-25.json").rename(tmp_path / "layer_h100_2026-11-25_0800.json")
    text = report.report(str(tmp_path))
    assert text.count("Suite `layer`") == 1  # the earlier record's rows are all in the latest: only beside it
    # a later run of one step: the record before stays shown for its other steps; each step is
    # compared with its own run before
    _suite_file(
        tmp_path,
        "layer",
        {
            "layer_profile": {
                "dense_bf16_gemm_tflops": 790.0,
                "rows": [
                    dict(row("a", 7.7, 0.4), breakdown={"step_gpu_busy_ms": 5.1, "step_gpu_ms_by_kernel_class": {}})
                ],
            }
        },
        date="2026-11-25T11:00:00Z",
    )
    text = report.report(str(tmp_path))
    assert text.count("Suite `layer`") == 2 and "| layer_fine | b | none | torch | graph | 21.00 |" in text
    assert (
        "| layer_profile | a, none, torch, graph | GPU busy ms | 2026-11-25T09:00 | 2026-11-25T11:00 | 5.000 | 5.100 | "
        "1.020 | yes | yes |" in text
    )
    assert "| layer_fine | a, none, torch, graph | share of dense | 2026-11-25T08:00 | 2026-11-25T09:00 |" in text
    assert "5 of 6 figures within 3% of the run before" in text


def test_suites_listed_and_steps_planned(capsys):
    from bench.__main__ import SUITES, gpu_tag, main, narrowed, step_command

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(
        name in out for name in ("layer", "trainer", "vs-torchtitan", "deepseek-v3", "loss-curve", "kernels", "2gpu")
    )
    assert gpu_tag({"device": "NVIDIA H200", "device_count": 2}) == "h200x2"
    assert gpu_tag({"device": "x86_64", "device_count": 0}) == "cpu"
    step = SUITES["layer"].steps[0]
    after, before = step_command(step, "/o", "s"), step_command(step, "/o", "s@base")
    assert "titan_fold,titan_fold_quack" in after and before[:-4] == after[:-4]  # the code before runs the same
    assert before[-4:] == ["--name", "s@base", "--out-dir", "/o"]
    two = step_command(SUITES["2gpu"].steps[0], "/o", "c")
    assert two[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    vs = step_command(SUITES["vs-torchtitan"].steps[1], "/o", "t", ours_path="/o/q.json")
    assert vs[-2:] == ["--ours", "/o/q.json"]
    # --cases: a trainer step keeps only the asked cases, in its own order; a step without --cases runs whole
    trainer = SUITES["trainer"].steps[0]
    cut = step_command(
        trainer, "/o", "t", wanted={"cases": ["1gpu_bf16params_auxfree_compiled_profile", "1gpu_bf16params_auxfree"]}
    )
    assert cut[cut.index("--cases") + 1] == "1gpu_bf16params_auxfree,1gpu_bf16params_auxfree_compiled_profile"
    assert narrowed(trainer.args, {"cases": ["dp2_ep2"]}) is None
    assert narrowed(step.args, {"cases": ["x"]}) == step.args
    # --shapes and --impls narrow the MoE-layer steps (bench/moe_layer.py's --shapes and --impl) alike
    coarse = next(st for st in SUITES["layer"].steps if st.name == "layer_coarse")
    cut = narrowed(
        coarse.args, {"shapes": ["mixtral_8x22b"], "impls": ["titan_fold_quack", "titan_fold"], "cases": None}
    )
    assert (
        cut[cut.index("--shapes") + 1] == "mixtral_8x22b"
        and cut[cut.index("--impl") + 1] == "titan_fold,titan_fold_quack"
    )
    assert len(cut) == len(coarse.args) and narrowed(coarse.args, {"shapes": ["qwen3_30b_a3b"]}) is None
    assert narrowed(trainer.args, {"shapes": ["mixtral_8x22b"]}) == trainer.args
    # and the grouped GEMMs of the kernels suite, whose coarse shapes QuACK takes minutes to tune
    gemms = next(st for st in SUITES["kernels"].steps if st.name == "grouped_gemm")
    assert narrowed(gemms.args, {"shapes": ["mixtral_8x22b_g8t8", "qwen3_30b_a3b"], "impls": ["quack"]}) == [
        "--shapes",
        "qwen3_30b_a3b,mixtral_8x22b_g8t8",
        "--impl",
        "quack",
    ]
    for suite in SUITES.values():  # every trainer case parses
        for st in suite.steps:
            if st.script == "train_step":
                for case in st.args[st.args.index("--cases") + 1].split(","):
                    train_step.parse_case(case)


@pytest.mark.parametrize("base_last", [False, True])
def test_suite_interleaves_each_step_with_the_code_before(tmp_path, monkeypatch, base_last):
    """python -m bench vs-torchtitan --base B: per step, the code before's process and this
    code's, @base first or (--base-last) second; the torchtitan step reads the titan_fold step's
    figures of its own checkout; the record holds every step under its name."""
    import bench.__main__ as suite

    ran = []

    def fake_run_step(step, root, out_dir, name, ours_path, wanted):
        ran.append((name, root, ours_path and os.path.basename(ours_path)))
        return {"command": name, "returncode": 0, "wall_s": 0.0, "figures": {"name": name}}

    monkeypatch.setattr(suite, "run_step", fake_run_step)
    monkeypatch.setattr(suite, "env_info", lambda: {"device": "NVIDIA H200", "device_count": 1})
    argv = [
        "vs-torchtitan",
        "--steps",
        "qwen3_30b_a3b_l12,torchtitan_qwen3_30b_a3b_l12",
        "--base",
        str(tmp_path / "b"),
        "--out-dir",
        str(tmp_path),
    ] + (["--base-last"] if base_last else [])
    record = json.loads(open(suite.main(argv)).read())
    pairs = [
        ("qwen3_30b_a3b_l12@base", str(tmp_path / "b"), None),
        ("qwen3_30b_a3b_l12", suite.ROOT, None),
        ("torchtitan_qwen3_30b_a3b_l12@base", str(tmp_path / "b"), "qwen3_30b_a3b_l12@base.json"),
        ("torchtitan_qwen3_30b_a3b_l12", suite.ROOT, "qwen3_30b_a3b_l12.json"),
    ]
    want = [pairs[1], pairs[0], pairs[3], pairs[2]] if base_last else pairs
    assert ran == want
    assert record["figures"] == {name: {"name": name} for name, _, _ in pairs}
    with pytest.raises(SystemExit):
        suite.main(["trainer", "--base-last"])


def test_suite_narrowed_to_one_shape_runs_only_the_steps_that_hold_it(tmp_path, monkeypatch):
    """python -m bench layer --shapes mixtral_8x22b --impls titan_fold_quack: the one layer step
    whose shapes include it runs, with its lists cut to what was asked; the others are skipped.
    Everything but the step's process runs (run_step included)."""
    import subprocess
    from types import SimpleNamespace

    import bench.__main__ as suite

    ran = []

    def fake_run(cmd, **kwargs):
        ran.append(cmd)
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(suite, "env_info", lambda: {"device": "NVIDIA H100", "device_count": 1})
    suite.main(["layer", "--shapes", "mixtral_8x22b", "--impls", "titan_fold_quack", "--out-dir", str(tmp_path)])
    assert len(ran) == 1
    cmd = ran[0]
    assert cmd[cmd.index("--name") + 1] == "layer_coarse"
    assert cmd[cmd.index("--shapes") + 1] == "mixtral_8x22b" and cmd[cmd.index("--impl") + 1] == "titan_fold_quack"


@pytest.mark.parametrize(
    "name, tflops",
    [
        # torch.cuda.get_device_name(); dense bf16 (half the datasheets' figures with sparsity)
        pytest.param("NVIDIA H100 80GB HBM3", 989, id="H100-SXM"),
        pytest.param("NVIDIA H100 PCIe", 756, id="H100-PCIe"),
        pytest.param("NVIDIA H100 NVL", 835, id="H100-NVL"),
        pytest.param("NVIDIA H200", 989, id="H200-SXM"),
        pytest.param("NVIDIA H200 NVL", 835, id="H200-NVL"),
        pytest.param("NVIDIA A100-SXM4-80GB", 312, id="A100-SXM4-80GB"),
        pytest.param("NVIDIA A100-PCIE-40GB", 312, id="A100-PCIe-40GB"),
        pytest.param("NVIDIA H100", None, id="no-such-name"),
        pytest.param("cpu", None, id="cpu"),
    ],
)
def test_mfu_peak_comes_from_the_exact_device_name(name, tflops):
    """The trainer's and the bench's MFU divide by the peak of the GPU's exact name: an H100 PCIe
    or NVL is not given the SXM's, and a name the table lacks gets no peak (NaN: MFU null)."""
    from titan_fold.trainer.metrics import peak_flops

    got = peak_flops(name)
    assert got == tflops * 1e12 if tflops else got != got


def test_trace_summary(tmp_path):
    from bench import trace_summary

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#10", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "_ZN7cutlass13device_kernel_GemmUniversal", "ts": 0, "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 400, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "pytorch_flash::flash_fwd_kernel", "ts": 500, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "void cudnn::fusion::convert_dq_to_16bits<true>", "ts": 600, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 450, "dur": 200},  # overlaps
        {"ph": "X", "cat": "kernel", "name": "void at::native::multi_tensor_apply_kernel<Adam>", "ts": 800, "dur": 50},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 900, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
        # a generated kernel is the optimizer's when launched inside an optimizer step's range
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#Container.step", "ts": 690, "dur": 60},
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 700, "dur": 5},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 705, "dur": 2},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 710, "dur": 5, "args": {"correlation": 7}},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "triton_poi_fused_lerp_mul_sqrt_0",
            "ts": 920,
            "dur": 30,
            "args": {"correlation": 7},
        },
        {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "ts": 755, "dur": 15},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 760, "dur": 5, "args": {"correlation": 8}},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "triton_poi_fused_add_0",
            "ts": 975,
            "dur": 20,
            "args": {"correlation": 8},
        },
        # queued in the step before (its launch is not in the trace), run inside this one: in no class
        {
            "ph": "X",
            "cat": "kernel",
            "name": "triton_poi_fused_lerp_mul_sqrt_0",
            "ts": 985,
            "dur": 15,
            "args": {"correlation": 3},
        },
    ]
    path = tmp_path / "iteration_10" / "rank0_trace.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"traceEvents": events}))
    assert trace_summary.find_trace(str(tmp_path)) == str(path)
    s = trace_summary.summarize_trace(str(path))
    assert s["step_wall_ms"] == 1.0
    assert s["kernel_ms_by_class"] == {
        "grouped_gemm": 0.4,
        "nccl": 0.2,
        "attention": 0.14,
        "dense_gemm": 0.1,
        "optimizer": 0.08,
        "elementwise_other": 0.02,
        "memcpy_memset": 0.01,
    }
    assert s["gpu_busy_ms"] == pytest.approx(0.76)  # [0, 650] + [800, 850] + [900, 910] + [920, 950] + [975, 995]
    assert s["earlier_step_ms"] == pytest.approx(0.015)
    # idle from the first kernel to the last: 650-800, 850-900, 950-975 (910-920 is a kernel boundary)
    idle = s["idle"]
    assert idle["idle_ms"] == pytest.approx(0.225) and idle["waits"] == 3
    assert [(g["ms"], g["at_ms"]) for g in idle["longest"]] == [(0.15, 0.65), (0.05, 0.85), (0.025, 0.95)]
    assert idle["longest"][0]["after_kernel"] == "ncclDevKernel_AllGather"
    assert idle["longest"][0]["before_kernel"] == "void at::native::multi_tensor_apply_kernel<Adam>"
    assert idle["longest"][2]["launched_in"] == "aten::add_"  # its launch at 760
    assert s["top_kernels_ms"]["triton_poi_fused_lerp_mul_sqrt_0"] == pytest.approx(0.03)


@pytest.mark.parametrize("share", [0.5, 0.7, 0.9])
def test_rank_share_router_moves_the_asked_share(share):
    """--ep-rank-share: the remapped choices put `share` of the assignments on EP rank 0's
    experts, keep each choice's index within its rank's block and its combine weight."""
    torch.manual_seed(0)
    args = MoEArgs(num_experts=16, top_k=4, moe_ffn_dim=8)
    router = moe_layer.RankShareRouter(MoE(32, args).router, share, ep=4, seed=3)
    x = torch.randn(4096, 32)
    natural = router.inner(x, 4096)
    routing = router(x, 4096)
    per_rank = 16 // 4
    rank = routing.experts // per_rank
    assert (rank == 0).float().mean().item() == pytest.approx(share, abs=0.01)
    for r in (1, 2, 3):  # the rest spread evenly over the other ranks
        assert (rank == r).float().mean().item() == pytest.approx((1 - share) / 3, abs=0.01)
    assert torch.equal(routing.experts % per_rank, natural.experts % per_rank)
    assert torch.equal(routing.probs, natural.probs)
    assert torch.equal(routing.tokens_per_expert, torch.bincount(routing.experts.flatten(), minlength=16).float())
    assert routing.record[2].item() == pytest.approx(
        (routing.tokens_per_expert.max() / routing.tokens_per_expert.mean()).item()
    )
    assert router.observed_share() == pytest.approx((rank == 0).float().mean().item())
    keep = moe_layer.RankShareRouter(router.inner, None, ep=4, seed=3)
    assert torch.equal(keep(x, 4096).experts, natural.experts)
    assert keep.observed_share() == pytest.approx((natural.experts < per_rank).float().mean().item())


def test_benchmarks_doc_quotes_the_report():
    """docs/benchmarks.md's Results tables are `python -m bench.report`'s summary over
    bench/results and docs/benchmarks/results.md holds its full report, as it prints them today
    (no hand-copied figures); the summary lists every suite's latest record by its file."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = os.path.join(root, "bench", "results")
    for page, tables in (
        ("benchmarks.md", report.summary(results).strip()),
        (os.path.join("benchmarks", "results.md"), report.report(results).strip()),
    ):
        with open(os.path.join(root, "docs", page)) as f:
            doc = f.read()
        assert tables and tables in doc, f"docs/{page}: run `python -m bench.report --write`"
    for recs in report.records(results).values():
        assert os.path.exists(os.path.join(root, recs[0]["_file"]))
        assert f"`{recs[0]['_file']}`" in report.summary(results)


def test_grouped_gemm_smoke(tmp_path):
    """bench/grouped_gemm.py on the CPU, tiny shape: every figure of the schema, TFLOP/s as
    FLOPs over ms (the up GEMMs, of w13, twice the down ones), the GEMM operands as autograd
    passed them."""
    from bench import grouped_gemm

    fig = grouped_gemm.main(["--smoke", "--out-dir", str(tmp_path)])
    with open(tmp_path / "grouped_gemm.json") as f:
        rec = json.load(f)
    assert set(common.SCHEMA_KEYS) <= set(rec) and rec["figures"]["rows"] == json.loads(json.dumps(fig["rows"]))
    assert rec["figures"]["quack_left_out"] == "needs a CUDA GPU"
    row, equal = rec["figures"]["rows"]
    assert (row["counts"], row["impl"], equal["counts"], equal["impl"]) == ("drawn", "torch", "equal", "torch")
    assert equal["rows_per_expert_min"] == equal["rows_per_expert_max"] == 128 // 8
    assert "error" not in row and row["shape"] == "tiny" and row["rows"] == 64 * 2
    shape = moe_layer.SHAPES["tiny"]
    assert row["gemm_gflop_each"] == pytest.approx(2 * 128 * shape["dim"] * shape["ffn"] / 1e9)
    assert set(row["gemms"]) == {f"{m}_{op}" for m in ("up", "down") for op in ("fwd", "dgrad", "wgrad")}
    for name, v in row["gemms"].items():
        flop = (2 if name.startswith("up_") else 1) * row["gemm_gflop_each"] * 1e9
        assert v["ms"] > 0 and v["tflops"] == pytest.approx(flop / (v["ms"] * 1e-3) / 1e12)
    assert set(row["bmm_equal_groups"]) == {"up_fwd", "up_wgrad", "down_fwd", "down_wgrad"}
    E, R = shape["experts"], 128
    for m, (K, N) in (("up", (shape["dim"], 2 * shape["ffn"])), ("down", (shape["ffn"], shape["dim"]))):
        # what autograd passed (recorded): x @ w.T, g @ w, g.t() @ x with w [E, N, K]
        assert row["operand_layouts"][f"{m}_fwd"] == [[[R, K], [K, 1]], [[E, K, N], [N * K, 1, K]]]
        assert row["operand_layouts"][f"{m}_dgrad"] == [[[R, N], [N, 1]], [[E, N, K], [N * K, K, 1]]]
        assert row["operand_layouts"][f"{m}_wgrad"] == [[[N, R], [1, N]], [[R, K], [K, 1]]]
    assert row["rows_per_expert_min"] <= 128 // 8 <= row["rows_per_expert_max"]
    assert row["routed_gemms_ms"] == pytest.approx(sum(v["ms"] for v in row["gemms"].values()))
    assert row["copy_tbps"] == rec["figures"]["copy_tbps"] > 0 and 0 < row["share_of_roofline"]
    assert row["roofline_ms"] == pytest.approx(sum(v["bound_ms"] for v in row["gemms"].values()))
    dense = rec["figures"]["dense_bf16_gemm_tflops"]
    assert row["gemm_bound_share"] == pytest.approx(row["routed_gemms_tflops"] / dense)
    shared = 6 * 64 * 3 * shape["dim"] * shape["shared_ffn"]
    assert row["shared_at_dense_ms"] == pytest.approx(shared / (dense * 1e12) * 1e3)
    assert row["gemm_bound_share_with_shared"] == pytest.approx(
        (9 * row["gemm_gflop_each"] * 1e9 + shared)
        / ((row["routed_gemms_ms"] + row["shared_at_dense_ms"]) * 1e-3)
        / 1e12
        / dense
    )
    assert 0 < row["gemm_bound_share_with_shared"] < row["layer_bound_share"]  # + router and gate FLOPs
    with pytest.raises(SystemExit):  # max-autotune needs CUDA
        grouped_gemm.parse(["--device", "cpu", "--autotune", "tiny"])


def test_grouped_gemm_quack_calls(tmp_path, monkeypatch):
    """bench/grouped_gemm.py --impl quack times moe/quack.py's own calls, here on float64
    stand-ins for QuACK on the CPU (tests/test_moe_fast_paths.py): up fwd is the gathering GEMM
    with the SwiGLU epilogue, down dgrad gemm_dgated, the other four plain grouped GEMMs (varlen-K
    for the wgrads); each figure is its FLOPs over its ms."""
    from helpers import _stand_in_quack, _stand_in_up_epilogue

    import titan_fold.moe.quack as qm
    from bench import grouped_gemm

    calls = []
    monkeypatch.setattr(qm, "_PLANS", {})
    monkeypatch.setattr(qm, "_QUACK", _stand_in_quack(calls))
    monkeypatch.setattr(qm, "_UP_EPILOGUE", _stand_in_up_epilogue(calls))
    monkeypatch.setattr(qm, "_LOADED", True)
    monkeypatch.setattr(grouped_gemm, "quack_missing", lambda device: None)
    fig = grouped_gemm.main(["--smoke", "--impl", "quack", "--counts", "equal", "--out-dir", str(tmp_path)])
    (row,) = fig["rows"]
    assert "error" not in row and (row["impl"], row["counts"]) == ("quack", "equal") and "quack_left_out" not in fig
    assert list(row["gemms"]) == ["up_fwd", "up_dgrad", "up_wgrad", "down_fwd", "down_dgrad", "down_wgrad"]
    for name, v in row["gemms"].items():
        flop = (2 if name.startswith("up_") else 1) * row["gemm_gflop_each"] * 1e9
        assert v["ms"] > 0 and v["tflops"] == pytest.approx(flop / (v["ms"] * 1e-3) / 1e12)
    assert row["routed_gemms_ms"] == pytest.approx(sum(v["ms"] for v in row["gemms"].values()))
    # operands: one up fwd, one gemm_dgated; then per timed call (warm-up 1 + 2 timed) its kind
    kinds = [kind for kind, _ in calls]
    assert kinds[:2] == ["gated", "dgated"]
    plain = ["tuned", "pinned", "replay", "replay"]  # a signature's first call: tuned, then its config pinned
    timed = ["gated"] * 3 + plain * 3 + ["dgated"] * 3 + plain
    # then each of the four varlen-M GEMMs with our launch and with QuACK's tuned one (a plain GEMM through
    # gemm_tuned at every call), 3 rounds
    rounds = (["gated"] * 6 + ["replay"] * 3 + ["tuned"] * 3 + ["replay"] * 3 + ["tuned"] * 3 + ["dgated"] * 6) * 3
    assert kinds[2:] == timed + rounds
    # the four varlen-M GEMMs again, with moe/quack.py's configs and with QuACK's tuning, in turn: 3 rounds
    tunings = row["tunings"]
    assert list(tunings) == ["up_fwd", "up_dgrad", "down_fwd", "down_dgrad", "varlen_m"]
    for name in ("up_fwd", "up_dgrad", "down_fwd", "down_dgrad"):
        t = tunings[name]
        assert t["quack_over_titan_fold"] == pytest.approx(t["quack"]["ms"] / t["titan_fold"]["ms"])
        flop = (2 if name.startswith("up_") else 1) * row["gemm_gflop_each"] * 1e9
        assert t["quack"]["tflops"] == pytest.approx(flop / (t["quack"]["ms"] * 1e-3) / 1e12)
    total = {
        w: sum(tunings[n][w]["ms"] for n in ("up_fwd", "up_dgrad", "down_fwd", "down_dgrad"))
        for w in ("titan_fold", "quack")
    }
    assert tunings["varlen_m"]["quack_over_titan_fold"] == pytest.approx(total["quack"] / total["titan_fold"])
    shape = moe_layer.SHAPES["tiny"]
    E, dim, ffn = shape["experts"], shape["dim"], shape["ffn"]
    rows, per_expert = grouped_gemm.routing(64, 2, E, "drawn")
    fns, quack_tuned = grouped_gemm.quack_gemms(
        64, rows, per_expert, dim, ffn, E, torch.device("cpu"), torch.bfloat16, torch.Generator().manual_seed(0)
    )
    shapes = {n: tuple(t.shape for t in fn()) if n in ("up_fwd", "down_dgrad") else fn().shape for n, fn in fns.items()}
    assert shapes == {
        "up_fwd": ((128, 2 * ffn), (128, ffn)),
        "up_dgrad": (128, dim),
        "up_wgrad": (E, 2 * ffn, dim),
        "down_fwd": (128, dim),
        "down_dgrad": ((128, 2 * ffn), (128, ffn), (128,)),
        "down_wgrad": (E, dim, ffn),
    }
    assert quack_tuned["up_fwd"]() is None  # writes its own ab and h
    assert [tuple(t.shape) for t in quack_tuned["down_dgrad"]()] == [(128, 2 * ffn), (128, ffn), (128,)]
    assert quack_tuned["up_dgrad"]()[0] is not None and quack_tuned["down_fwd"]()[0] is not None  # QuACK's plans
    with pytest.raises(SystemExit):
        grouped_gemm.parse(["--impl", "cutlass"])


def test_grouped_gemm_roofline_by_hand():
    """Qwen3-30B-A3B at 8192 tokens (R = 65536 rows, 128 experts of 768, dim 2048): each GEMM's
    fewest bytes counted by hand, QuACK's epilogue operands added to up fwd and down dgrad; on a
    card of 800 TFLOP/s and 3 TB/s the down dgrad is bound by its bytes, the up fwd by its FLOPs."""
    from bench import grouped_gemm

    R, E, dim, ffn = 65536, 128, 2048, 768
    x, ab, h = R * dim * 2, R * 2 * ffn * 2, R * ffn * 2  # bf16 rows: 268 MB, 201 MB, 101 MB
    w13, w2 = E * 2 * ffn * dim * 2, E * dim * ffn * 2  # 805 MB, 403 MB
    torch_bytes = grouped_gemm.gemm_bytes(R, E, dim, ffn)
    assert torch_bytes == {
        "up_fwd": x + w13 + ab,
        "up_dgrad": ab + w13 + x,
        "up_wgrad": ab + x + w13,
        "down_fwd": h + w2 + x,
        "down_dgrad": x + w2 + h,
        "down_wgrad": x + h + w2,
    }
    quack_bytes = grouped_gemm.gemm_bytes(R, E, dim, ffn, "quack")
    assert quack_bytes["up_fwd"] == x + w13 + ab + h + 4 * R  # + h written, p read
    assert quack_bytes["down_dgrad"] == x + w2 + ab + ab + h + 8 * R  # (gate, up) read, dab and h written, p, dp
    assert {n: b for n, b in quack_bytes.items() if n not in ("up_fwd", "down_dgrad")} == {
        n: b for n, b in torch_bytes.items() if n not in ("up_fwd", "down_dgrad")
    }
    gemms = {n: {"ms": 0.5} for n in torch_bytes}
    got = grouped_gemm.roofline(gemms, quack_bytes, R, dim, ffn, 800.0, 3.0)
    up_flop_ms = 2 * 2 * R * dim * ffn / 800e12 * 1e3  # 0.515 ms
    dgrad_byte_ms = quack_bytes["down_dgrad"] / 3e12 * 1e3  # 1.17 GB: 0.392 ms
    assert gemms["up_fwd"]["bound_by"] == "compute" and gemms["up_fwd"]["bound_ms"] == pytest.approx(up_flop_ms)
    assert gemms["down_dgrad"]["bound_by"] == "memory" and gemms["down_dgrad"]["bound_ms"] == pytest.approx(
        dgrad_byte_ms
    )
    assert gemms["down_dgrad"]["share_of_bound"] == pytest.approx(dgrad_byte_ms / 0.5)
    assert gemms["down_dgrad"]["gb"] == pytest.approx(quack_bytes["down_dgrad"] / 1e9)
    assert got["roofline_ms"] == pytest.approx(sum(g["bound_ms"] for g in gemms.values()))
    assert got["share_of_roofline"] == pytest.approx(got["roofline_ms"] / 3.0) and got["copy_tbps"] == 3.0


def test_grouped_gemm_bounds_by_hand():
    """Qwen2-57B-A14B at 8192 tokens, the GEMMs 1 to 6 ms, dense 500 TFLOP/s: the routed experts
    run w13 (up, 2 * 2 * 65536 * 3584 * 2560 FLOPs) and w2 (down, half that), each fwd, dgrad, wgrad."""
    from bench import grouped_gemm

    gemm = 2 * 65536 * 3584 * 2560
    assert grouped_gemm.gemm_flops(65536, 3584, 2560) == gemm
    ms = {"up_fwd": 1.0, "up_dgrad": 2.0, "up_wgrad": 3.0, "down_fwd": 4.0, "down_dgrad": 5.0, "down_wgrad": 6.0}
    b = grouped_gemm.bounds(ms, 8192, moe_layer.SHAPES["qwen2_57b_a14b"], 500.0)
    assert b["routed_gemms_ms"] == 1 + 2 + 3 + 4 + 5 + 6
    routed_tflops = 9 * gemm / 21e-3 / 1e12
    assert b["routed_gemms_tflops"] == pytest.approx(routed_tflops)  # 515.4
    assert b["gemm_bound_share"] == pytest.approx(routed_tflops / 500)
    shared = 6 * 8192 * 3 * 3584 * 20480
    shared_ms = shared / 500e12 * 1e3  # 21.6 ms at the dense rate
    assert b["shared_at_dense_ms"] == pytest.approx(shared_ms)
    assert b["gemm_bound_share_with_shared"] == pytest.approx((9 * gemm + shared) / ((21 + shared_ms) * 1e-3) / 500e12)
    router_gate = 6 * 8192 * 3584 * 64 + 6 * 8192 * 3584
    assert b["layer_bound_share"] == pytest.approx(
        (9 * gemm + shared + router_gate) / ((21 + shared_ms) * 1e-3) / 500e12
    )


def test_grouped_gemm_report_table(tmp_path):
    gemms = {
        f"{m}_{op}": {"ms": 1.0, "tflops": t}
        for (m, op), t in zip(
            [(m, op) for m in ("up", "down") for op in ("fwd", "dgrad", "wgrad")],
            (447.2, 352.1, 397.6, 440.3, 475.3, 448.3),
            strict=True,
        )
    }
    row = {
        "shape": "qwen3_30b_a3b",
        "gemms": gemms,
        "routed_gemms_tflops": 410.5,
        "gemm_bound_share": 0.5549,
        "gemm_bound_share_with_shared": 0.5549,
        "experts_fwd_bwd": {"separate_ms": 3.21, "stacked_over_separate": 0.912},
    }
    quack = {
        **row,
        "counts": "equal",
        "impl": "quack",
        "gemm_bound_share": 0.7012,
        "share_of_roofline": 0.8123,
        "tunings": {"up_fwd": {"quack_over_titan_fold": 1.1834}, "varlen_m": {"quack_over_titan_fold": 1.0412}},
    }
    before = {**quack, "counts": "drawn", "tunings": None, "up_fwd_tunings": {"quack_over_titan_fold": 1.0921}}
    del before["tunings"]
    _suite_file(
        tmp_path,
        "kernels",
        {
            "grouped_gemm": {
                "dense_bf16_gemm_tflops": 739.8,
                "rows": [quack, before, row, {"shape": "mixtral_8x22b", "error": "OutOfMemoryError: x"}],
            }
        },
    )
    text = report.report(str(tmp_path))
    assert "Routed grouped GEMMs alone:" in text
    # a row without counts and impl (a record from before them) is torch's at drawn counts
    assert (
        "| qwen3_30b_a3b | drawn | torch | 739.8 | 447.2 | 352.1 | 397.6 | 440.3 | 475.3 | 448.3 | 410.5 | 0.555 | "
        "0.555 | n/a | n/a | n/a | 0.912 |"
    ) in text
    assert (
        "| qwen3_30b_a3b | equal | quack | 739.8 | 447.2 | 352.1 | 397.6 | 440.3 | 475.3 | 448.3 | 410.5 | 0.701 | "
        "0.555 | 0.812 | 1.183 | 1.041 |"
    ) in text
    # a record from before the four varlen-M GEMMs were timed both ways: the up projection's alone
    assert (
        "| qwen3_30b_a3b | drawn | quack | 739.8 | 447.2 | 352.1 | 397.6 | 440.3 | 475.3 | 448.3 | 410.5 | 0.701 | "
        "0.555 | 0.812 | 1.092 | n/a |"
    ) in text
    lines = report.grouped_gemm_table(report.latest(str(tmp_path))[0])
    assert len({line.count("|") for line in lines}) == 1  # the error row has every column
    assert "| mixtral_8x22b | drawn | torch | error: OutOfMemoryError: x |" in text


def test_grad_norm_smoke(tmp_path):
    """bench/grad_norm.py on the CPU: every way gives the float64 norm of the same gradients, the
    per-tensor one and titan_fold's (the same computation off CUDA) within float32 accumulation,
    torch's foreach one within bf16 rounding."""
    from bench import grad_norm

    figures = grad_norm.main(["--smoke", "--out-dir", str(tmp_path)])
    rec = json.loads((tmp_path / "grad_norm.json").read_text())
    assert rec["figures"]["parameters"] == figures["parameters"] > 0
    rows = {r["way"]: r for r in figures["rows"]}
    assert rows["per_tensor"]["rel_err_vs_float64"] < 1e-5
    assert rows["titan_fold"]["norm"] == rows["per_tensor"]["norm"]
    assert rows["foreach"]["rel_err_vs_float64"] < 1e-2
    assert all(r["ms"] > 0 and r["host_ms"] > 0 for r in rows.values())


def test_attention_smoke(tmp_path):
    """bench/attention.py on the CPU: the models' call (torch's choice of backend) equals the
    float32 math backend; MLA's value width (other than the query's) is refused by flash and
    taken by torch's choice; the report lists every row."""
    from bench import attention, report

    figures = attention.main(["--smoke", "--out-dir", str(tmp_path)])
    rows = {(r["family"], r["way"]): r for r in figures["rows"]}
    assert rows[("deepseek_v3", "default")]["qk_dim"] != rows[("deepseek_v3", "default")]["v_dim"]
    assert "error" in rows[("deepseek_v3", "flash")]
    for family in ("qwen3_moe", "deepseek_v3"):
        r = rows[(family, "default")]
        assert r["max_rel_err_vs_fp32_math"] < 1e-5 and r["ms"] > 0
        assert r["tflops"] == pytest.approx(
            6 * r["batch"] * r["seq_len"] ** 2 * r["heads"] * (r["qk_dim"] + r["v_dim"]) / 2 / (r["ms"] * 1e-3) / 1e12
        )
    rec = json.loads((tmp_path / "attention.json").read_text())
    lines = report.attention_table({"figures": {"attention": rec["figures"]}})
    assert len(lines) == 2 + len(figures["rows"]) and len({line.count("|") for line in lines}) == 1


def test_launch_smoke(tmp_path):
    """bench/launch.py on the CPU: every call runs and has a host time; the report sets the code
    before's time beside each call and their ratio."""
    from bench import launch, report

    figures = launch.main(["--smoke", "--out-dir", str(tmp_path)])
    assert [r["call"] for r in figures["rows"]] == list(launch.calls(torch.device("cpu")))
    assert all(r["host_us"] > 0 for r in figures["rows"])
    before = {"rows": [{**r, "host_us": 2 * r["host_us"]} for r in figures["rows"]]}
    lines = report.launch_table({"figures": {"launch": figures, "launch@base": before}})
    assert len(lines) == 2 + len(figures["rows"]) and all(line.endswith("| 2.00 |") for line in lines[2:])


@pytest.mark.slow
def test_dry_run_smoke(tmp_path):
    """bench/dry_run.py on debug_moe.toml at 2 ranks: the dry run without and with the collective
    check, each in a fresh process whose CPU time holds the dry run's own; a table row each."""
    from bench import dry_run, report

    figures = dry_run.main(["--smoke", "--out-dir", str(tmp_path)])
    rows = figures["rows"]
    assert [(r["config"], r["ranks"], r["collectives"]) for r in rows] == [
        ("debug_moe.toml", 2, False),
        ("debug_moe.toml", 2, True),
    ]
    assert [r["matched"] for r in rows] == [False, True]  # the collectives recorded and matched in the second only
    assert all(0 < r["dry_run_cpu_s"] <= r["process_cpu_s"] for r in rows), rows
    lines = report.dry_run_table({"figures": {"dry_run": figures}})
    assert len(lines) == 4 and lines[3].startswith("| debug_moe.toml | 2 | yes | "), lines


def test_master_step_smoke(tmp_path):
    """bench/master_step.py on the CPU: the one-pass steps move the weights as Adam / AdamW
    would (checked in tests/test_optimizer.py); here the script's record: bytes and bandwidth
    from the parameter count and the times, and the bf16 step's agreement with torch's fused
    AdamW (CPU here)."""
    from bench import master_step

    figures = master_step.main(["--smoke", "--out-dir", str(tmp_path)])
    rows = {r["kernel"]: r for r in figures["rows"]}
    assert set(rows) == {"master_step", "adam_step_bf16", "torch_fused_adamw_bf16", "add_fp32", "copy_fp32"}
    assert rows["master_step"]["bytes"] == 28 * figures["parameters"]
    assert rows["adam_step_bf16"]["bytes"] == rows["torch_fused_adamw_bf16"]["bytes"] == 14 * figures["parameters"]
    assert figures["bf16_agreement"]["max_ulps"] <= 1 and figures["bf16_agreement"]["fraction_off"] < 0.01
    for r in rows.values():
        assert r["tb_per_s"] == pytest.approx(r["bytes"] / (r["ms"] * 1e-3) / 1e12)
    assert json.loads((tmp_path / "master_step.json").read_text())["figures"]["parameters"] == figures["parameters"]


def _loss_row(case, losses):
    return {
        "case": case,
        "nproc": 1,
        "returncode": 0,
        "tokens_per_sec_per_gpu": 1.0,
        "tflops_per_gpu": 1.0,
        "mfu_pct": 1.0,
        "peak_memory_gib": 1.0,
        "step_time_s": 1.0,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_mean_last20": sum(losses[-20:]) / 20,
        "losses": losses,
    }


def _curve(*windows):
    """A loss curve: 20 steps at 2.0, then 20 steps at each of windows in turn."""
    return [2.0] * 20 + [w for level in windows for w in [level] * 20]


def test_report_loss_curves_step_by_step_and_by_20_step_means(tmp_path):
    """A loss curve beside the step's first case: one step 10% off (in the first 20 steps, which
    the curve's windows and level leave out), the 20-step means and the level 1% off."""
    ref, other = [2.0] * 40, [2.0] * 19 + [2.2] + [2.02] * 20
    _suite_file(tmp_path, "loss-curve", {"curve": {"rows": [_loss_row("torchgemm", ref), _loss_row("quack", other)]}})
    text = report.report(str(tmp_path))
    assert "| curve | torchgemm | 40 | 2.000 -> 2.000 | 2.0000 | 0.00% | 0.00% | +0.00% |" in text
    assert "| curve | quack | 40 | 2.000 -> 2.020 | 2.0200 | 10.00% | 1.00% | +1.00% |" in text
    assert "within" not in text  # no path ran twice: no pairs table


def test_report_loss_curves_within_and_across_paths(tmp_path):
    """Two runs of each path (rerun names the second): each path's later run against its earlier,
    every run of the second path against every run of the first, and the two paths' mean curves,
    by the largest 20-step-mean difference after step 20 and the level after step 20."""
    rows = [
        _loss_row("torchgemm", _curve(2.0, 2.0)),
        _loss_row("quack", _curve(2.04, 2.0)),
        _loss_row("torchgemm_rerun", _curve(1.96, 2.0)),
        _loss_row("quack_rerun", _curve(2.0, 2.0)),
    ]
    _suite_file(tmp_path, "loss-curve", {"curve": {"rows": rows}})
    text = report.report(str(tmp_path))
    assert "| curve | within torchgemm | 1 | 2.00% | -1.00% |" in text
    assert "| curve | within quack | 1 | 1.96% | -0.99% |" in text  # 2.00 / 2.04, 2.00 / 2.02
    # quack / torchgemm pairs: 2.04 / 1.96 the largest window; levels 2.00 / 2.00 up to 2.02 / 1.98
    assert "| curve | across paths (quack against torchgemm) | 4 | 4.08% | +0.00% to +2.02% |" in text
    # mean curves: 2.02 against 1.98 in the window, 2.01 against 1.99 after step 20
    assert "| curve | mean curve of quack (2 runs) against torchgemm (2 runs) | 1 | 2.02% | +1.01% |" in text


def test_report_pools_loss_curves_over_records_and_machines(tmp_path):
    """Every run of a loss-curve step in any record, by path: the levels after step 20 over runs,
    and the mean curves' difference with the standard error of the levels' difference."""
    _suite_file(
        tmp_path,
        "loss-curve",
        {"curve": {"rows": [_loss_row("torchgemm", _curve(2.0, 2.2)), _loss_row("quack", _curve(2.1, 2.1))]}},
    )
    _suite_file(
        tmp_path,
        "loss-curve",
        {
            "curve": {
                "rows": [
                    _loss_row("torchgemm", _curve(1.8, 2.0)),
                    _loss_row("quack_rerun", _curve(1.9, 1.9)),
                    _loss_row("quack", _curve(1.9, 2.0)),
                ]
            },
            "alone": {"rows": [_loss_row("torchgemm", _curve(2.0))]},
        },
        date="2026-11-26T10:00:00Z",
        device="NVIDIA H200",
    )
    text = report.report(str(tmp_path))
    assert "every recorded run, pooled over records and machines" in text
    # torchgemm levels 2.1, 1.9: mean 2.0, sd 0.1414; its mean curve 1.9, 2.1
    assert (
        "| curve | torchgemm | 2 | NVIDIA H100 80GB HBM3, NVIDIA H200 | 2.0000 | 0.1414 | (the reference) | | |" in text
    )
    # quack levels 2.1, 1.9, 1.95: mean 1.9833, sd 0.1041; its mean curve 1.9667, 2.0 against 1.9, 2.1:
    # windows 3.51% and 4.76%, level 1.9833 / 2.0 - 1; error sqrt(0.1041^2 / 3 + 0.1414^2 / 2) / 2.0
    assert (
        "| curve | quack | 3 | NVIDIA H100 80GB HBM3, NVIDIA H200 | 1.9833 | 0.1041 | 4.76% | -0.83% | 5.83% |" in text
    )
    assert "| alone |" not in text.split("pooled over records and machines")[1]  # one path: nothing to compare


def test_curves_smooth_and_plot(tmp_path):
    """bench/curves.py: each case's losses averaged over a trailing window, one line per case in the PNG."""
    from bench import curves

    record = {
        "env": {"device": "cpu"},
        "figures": {"family": "f", "proxy_flavor": "p", "rows": [{"case": "a", "losses": [4.0, 2.0, 0.0, 6.0]}]},
    }
    assert curves.curves(record, 1) == {"a": [4.0, 2.0, 0.0, 6.0]}
    assert curves.curves(record, 2) == {"a": [4.0, 3.0, 1.0, 3.0]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    curves.main([str(path), "--out", str(tmp_path / "c.png"), "--smooth", "3"])
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        curves.main([str(path), "--out", str(tmp_path / "d.png"), "--smooth", "0"])


def test_documents_smoke(tmp_path):
    from bench import documents

    rows = documents.main(["--smoke", "--out-dir", str(tmp_path)])["rows"]
    assert [(r["family"], r["seq_len"]) for r in rows] == [("qwen3_moe", 128), ("deepseek_v3", 128)]
    for r in rows:
        assert r["documents"] > 1 and r["max_rel_err_vs_each_document"] < 1e-5, r


def test_forced_routing_draws_the_chosen_load():
    """bench/forced_routing.py: under `skew` a quarter of the experts takes about half the picks,
    under `uniform` every expert about its share; each token's picks are distinct, the router's
    gate still gets its gradient, and leaving restores the router."""
    from helpers import DIM, make_layer

    from bench.forced_routing import forced_routing
    from titan_fold.moe import MoEArgs
    from titan_fold.moe.router import Router

    args = MoEArgs(num_experts=64, top_k=4, moe_ffn_dim=8, load_balance="none")
    moe = make_layer(args, torch.float32)
    x = torch.randn(4, 512, DIM)
    original = Router.forward
    for kind, hot_share in (("skew", 0.5), ("uniform", 0.25)):
        torch.manual_seed(0)
        with forced_routing(kind):
            routing = moe.router(x.flatten(0, 1), 512)
            moe(x).sum().backward()
        picks = routing.experts
        assert all(len(set(row)) == 4 for row in picks.tolist())
        share = float((picks < 16).float().mean())
        assert abs(share - hot_share) < 0.03, (kind, share)
        assert routing.tokens_per_expert.sum() == picks.numel()
        assert moe.router.gate.weight.grad is not None and moe.router.gate.weight.grad.abs().sum() > 0
        moe.zero_grad()
    assert Router.forward is original


def test_replica_planner_smoke(tmp_path):
    """bench/replicas.py end to end on the CPU: under the skew the plan cuts the largest rank's
    rows to the mean (the water level at this size), under uniform routing it never adds any."""
    from bench import replicas

    rows = replicas.main(["--smoke", "--out-dir", str(tmp_path)])["rows"]
    assert {(r["load"], r["mode"]) for r in rows} == {
        (lo, m) for lo in ("skew", "uniform") for m in ("eager", "compiled")
    }
    for r in rows:
        assert r["ms"] > 0 and r["largest_rank_rows_planned"] <= r["largest_rank_rows_without"]
        if r["load"] == "skew":
            assert r["largest_rank_rows_without"] > 1.2 * r["mean_rank_rows"]
            assert r["largest_rank_rows_planned"] == r["mean_rank_rows"]
    assert (tmp_path / "replicas.json").exists()


def test_comparable_table_counts_the_whole_model_per_token(tmp_path):
    """The full-depth suite's rows beside the published runs: TFLOP/s per GPU is tokens/s x the whole
    model's FLOPs per token in each count (Megatron's ~23 GFLOP for Qwen3-30B-A3B), the latest
    record's row replaces an earlier one's, and a published row follows the step it compares with."""
    from bench import flops

    fig = {"family": "qwen3_moe", "proxy_flavor": "30B-A3B-E16", "seq_len": 4096}
    row = {"case": "1gpu_bf16params_auxfree_compiled_uniform_b2_ga16", "tokens_per_sec_per_gpu": 10000.0}
    _suite_file(
        tmp_path, "full-depth", {"qwen3_30b_a3b_ep8_uniform": {**fig, "rows": [row]}}, date="2026-12-01T10:00:00Z"
    )
    later = dict(row, tokens_per_sec_per_gpu=20000.0)
    _suite_file(
        tmp_path, "full-depth", {"qwen3_30b_a3b_ep8_uniform": {**fig, "rows": [later]}}, date="2026-12-02T10:00:00Z"
    )
    table = report.published_table(report.records(str(tmp_path)))
    counts = flops.counts("qwen3_moe", "30B-A3B", 4096)
    ours = [line for line in table if "titan_fold, 1 x" in line]
    assert len(ours) == 1 and "| uniform |" in ours[0] and "| 2 x 16 |" in ours[0]
    cells = [c.strip() for c in ours[0].split("|")]
    assert cells[6:10] == [
        "20,000",
        *(f"{20000 * counts[k] / 1e12:,.0f}" for k in ("megatron", "titan_fold", "torchtitan")),
    ]
    assert cells[7] == "460"  # 20,000 tokens/s x 23.0 GFLOP
    assert "published: NeMo AutoModel, 8 x H100, EP8" in table[table.index(ours[0]) + 1]
    assert "EP16" not in "".join(table)  # no published row without a measured row of its mapping
