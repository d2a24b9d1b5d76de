"""torchtitan 0.2.2's own qwen3 MoE trainer at the proxy's widths, beside titan_fold's.

    python bench/vs_torchtitan.py --cases 1gpu_eager,1gpu_compiled --gpus 0 --ours <train_step result>
    python bench/vs_torchtitan.py --cases dp2_ep2_bf16params_b4 --gpus 0,1 --ours <train_step result>
    python bench/vs_torchtitan.py --cases 1gpu_bf16params_auxfree --family deepseek_v3 --proxy 16B-L4 --gpus 0 \
        --ours <bench/train_step.py result of the same cases, family and proxy>

Case names follow bench/train_step.py (parse_case) on the two bases torchtitan runs: 1gpu,
and dp2_ep2 (its FSDP2 over 2 GPUs with expert parallelism 2 borrowing the FSDP ranks, as
titan_fold's dp2_ep2). Without _bf16params: bf16 autocast over fp32 weights on one GPU
(torchtitan's default), FSDP2 mixed precision on two; with it, training.dtype = bfloat16
(bf16 weights). `--ours` rows of the same case name give the ratio. The worker needs a
GPU: torchtitan's trainer and MoE assume CUDA (tests check the widths and FLOP count on
the CPU instead).

torchtitan's model: its Qwen3 MoE (torchtitan.models.qwen3) with a flavor registered in
the worker process at the widths of titan_fold's proxy (`--family`, `--proxy`, see
bench/train_step.py's register_proxy): dim, layers, heads, head_dim, experts, top-k,
renormalization, shared expert width (as num_shared_experts of the expert width), vocab
32768, softmax scores, the aux-loss-free expert bias (torchtitan's default). With
`--family qwen3_moe` and our `_auxfree` cases both trainers run the same model (proxies
"30B-A3B-L<n>" and "57B-A14B-L<n>", the latter Qwen3 at Qwen2-57B-A14B's widths). With
the default qwen2_moe proxy ours differs: q/k norms (Qwen3 has them), qkv bias and the
shared expert's sigmoid gate (Qwen2 has them), aux loss against the aux-free bias. Data and tokenizer are titan_fold's (the stdlib byte corpus, the same
token stream), plugged into torchtitan's TrainSpec. Settings as bench/train_step.py: seq
4096, local batch 2, bf16 AMP with fp32 weights on one GPU, no activation checkpointing,
AdamW, log every step, medians after warm-up.

MFU is given twice: torchtitan's own count (torchtitan_flops_per_token: attention non-causal),
and titan_fold's formula (6 * N_active + 6 * n_layers * n_heads * head_dim * seq: causal) for
the titan_fold proxy, so both trainers are measured against one FLOP count per token
(bench/report.py shows both counts for both trainers). The ratio is titan_fold / torchtitan tokens/s,
read from `--ours` (a bench/train_step.py result of the same machine call).
"""

import argparse
import dataclasses
import json
import os
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.train_step import finish_row, parse_case, read_jsonl, run_group, summarize  # noqa: E402


def spec_name(family: str, proxy: str) -> str:
    """The TrainSpec registered for torchtitan's model at a proxy's widths."""
    return f"titan_fold_bench_{family}_{proxy}"


def qwen3_args(family: str, proxy: str, seq_len: int):
    """torchtitan's Qwen3ModelArgs at the widths of titan_fold's proxy flavor."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    from bench.train_step import register_proxy
    from titan_fold.models import FLAVORS

    register_proxy(family, proxy)
    ours = FLAVORS[family][proxy]
    moe = ours.moe
    return Qwen3ModelArgs(
        vocab_size=ours.vocab_size,
        max_seq_len=seq_len,
        head_dim=ours.head_dim,
        dim=ours.dim,
        n_layers=ours.n_layers,
        n_heads=ours.n_heads,
        n_kv_heads=ours.n_kv_heads,
        qk_norm=True,
        hidden_dim=ours.ffn_dim,
        rope_theta=ours.rope_theta,
        moe_enabled=True,
        moe_inter_dim=moe.moe_ffn_dim,
        moe_args=MoEArgs(
            num_experts=moe.num_experts,
            num_shared_experts=moe.shared_ffn_dim // moe.moe_ffn_dim,
            top_k=moe.top_k,
            score_func="softmax",
            route_norm=moe.norm_topk_prob,
            score_before_experts=False,
        ),
    )


def deepseek_v3_args(proxy: str, seq_len: int):
    """torchtitan's DeepSeekV3ModelArgs at the widths of titan_fold's deepseek_v3 proxy (e.g. "16B-L4"):
    MLA, routing, shared experts, dense first layers; SDPA with a causal mask (its 16B flavor
    uses flex attention over document masks); YaRN as ours (torchtitan applies it only past
    original_seq_len: the same FLOPs)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    from bench.train_step import register_proxy
    from titan_fold.models import FLAVORS

    register_proxy("deepseek_v3", proxy)
    ours = FLAVORS["deepseek_v3"][proxy]
    moe = ours.moe
    return DeepSeekV3ModelArgs(
        max_seq_len=seq_len,
        vocab_size=ours.vocab_size,
        dim=ours.dim,
        inter_dim=ours.ffn_dim,
        moe_inter_dim=moe.moe_ffn_dim,
        n_layers=ours.n_layers,
        n_dense_layers=ours.first_k_dense,
        n_heads=ours.n_heads,
        norm_eps=ours.norm_eps,
        moe_args=MoEArgs(
            num_experts=moe.num_experts,
            num_shared_experts=moe.shared_ffn_dim // moe.moe_ffn_dim,
            top_k=moe.top_k,
            score_func=moe.score_func,
            route_norm=moe.norm_topk_prob,
            route_scale=moe.routed_scaling_factor,
            score_before_experts=False,
            num_expert_groups=moe.num_groups if moe.num_groups > 1 else None,
            num_limited_groups=moe.group_topk if moe.num_groups > 1 else None,
        ),
        q_lora_rank=ours.q_lora_rank or 0,
        kv_lora_rank=ours.kv_lora_rank,
        qk_nope_head_dim=ours.qk_nope_head_dim,
        qk_rope_head_dim=ours.qk_rope_head_dim,
        v_head_dim=ours.v_head_dim,
        attn_type="sdpa",
        attn_mask_type="causal",
        original_seq_len=ours.original_max_seq_len,
        rope_theta=ours.rope_theta,
        rope_factor=ours.rope_factor,
        beta_fast=int(ours.beta_fast),
        beta_slow=int(ours.beta_slow),
        mscale=ours.mscale_all_dim,
    )


def register(family: str, proxy: str, seq_len: int) -> None:
    from torchtitan.models import deepseek_v3, qwen3
    from torchtitan.protocols.train_spec import register_train_spec

    from titan_fold.data import build_dataloader, build_tokenizer

    # torchtitan's own families' specs (titan_fold registers specs under its family names too)
    if family == "deepseek_v3":
        spec, args = deepseek_v3.get_train_spec(), deepseek_v3_args(proxy, seq_len)
    else:
        spec, args = qwen3.get_train_spec(), qwen3_args(family, proxy, seq_len)
    register_train_spec(
        spec_name(family, proxy),
        dataclasses.replace(
            spec,
            model_args={proxy: args},
            build_dataloader_fn=build_dataloader,
            build_tokenizer_fn=build_tokenizer,
            build_validator_fn=None,
        ),
    )


def worker(argv: list[str], family: str, proxy: str) -> None:
    """Under torchrun: torchtitan's Trainer as torchtitan.train.main runs it, plus a JSON line
    per logged step (its metric logger's dict) in <dump_folder>/metrics.jsonl."""
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    seq_len = int(argv[argv.index("--training.seq_len") + 1])
    register(family, proxy, seq_len)
    config = ConfigManager().parse_args(argv)
    trainer = Trainer(config)
    path = os.path.join(config.job.dump_folder, "metrics.jsonl")
    rank0 = int(os.environ.get("RANK", "0")) == 0
    original = trainer.metrics_processor.logger.log

    def log(metrics, step):
        original(metrics, step)
        if rank0:
            with open(path, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "loss": metrics["loss_metrics/global_avg_loss"],
                            "tokens_per_sec": metrics["throughput(tps)"],
                            "tflops": metrics["tflops"],
                            "mfu": metrics["mfu(%)"] if metrics["mfu(%)"] == metrics["mfu(%)"] else None,
                            "max_memory_gib": metrics["memory/max_reserved(GiB)"],
                            "time_per_step_s": metrics["time_metrics/end_to_end(s)"],
                        }
                    )
                    + "\n"
                )

    trainer.metrics_processor.logger.log = log
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def our_flops_per_token(family: str, proxy: str, seq_len: int) -> int:
    """titan_fold's FLOP count per token for its proxy (bench/flops.py)."""
    from bench.flops import titan_fold_flops_per_token
    from bench.train_step import register_proxy
    from titan_fold.models import FLAVORS

    register_proxy(family, proxy)
    return titan_fold_flops_per_token(FLAVORS[family][proxy], seq_len)


def torchtitan_flops_per_token(family: str, proxy: str, seq_len: int) -> int:
    """torchtitan 0.2.2's FLOP count per token (its model args' get_nparams_and_flops, what its
    trainer's MFU divides by) for the model this script builds at the proxy's widths, on the
    meta device."""
    import torch
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model
    from torchtitan.models.qwen3 import Qwen3Model

    if family in MOE_FORMULA_FAMILIES:
        return _moe_formula_flops_per_token(family, proxy, seq_len)
    if family == "deepseek_v3":
        args, build = deepseek_v3_args(proxy, seq_len), DeepSeekV3Model
        args.moe_impl = "standard"  # what its update_from_config sets in the trainer
    else:
        args, build = qwen3_args(family, proxy, seq_len), Qwen3Model
    with torch.device("meta"):
        model = build(args)
    return args.get_nparams_and_flops(model, seq_len)[1]


# families whose torchtitan count is its MoE models' shared formula (models/utils.py
# get_moe_model_nparams_and_flops) over titan_fold's model: gpt_oss's args call it with q.k plus v
# (2 x head_dim) for every layer, window or not; torchtitan 0.2.2 has no qwen3_5_moe or qwen3_next,
# whose linear-attention layers it would count as full attention
MOE_FORMULA_FAMILIES = ("gpt_oss", "qwen3_5_moe", "qwen3_next")


def _moe_formula_flops_per_token(family: str, proxy: str, seq_len: int) -> int:
    """torchtitan's MoE FLOP formula on the parameters of titan_fold's proxy (their names carry
    its substrings: embedding, moe.router, moe.experts), on the meta device."""
    from types import SimpleNamespace

    import torch
    from torchtitan.models.utils import get_moe_model_nparams_and_flops

    from bench.train_step import register_proxy
    from titan_fold.models import FLAVORS, Transformer

    register_proxy(family, proxy)
    ours = dataclasses.replace(FLAVORS[family][proxy], max_seq_len=seq_len)
    with torch.device("meta"):
        model = Transformer(ours)
    args = SimpleNamespace(n_layers=ours.n_layers, n_heads=ours.n_heads, moe_args=ours.moe)
    return get_moe_model_nparams_and_flops(args, model, 2 * ours.head_dim, seq_len)[1]


def _unprofiled(case: str) -> tuple:
    base, mods = parse_case(case)
    return base, {**mods, "profile": False}


def torchtitan_args(case: str, a) -> tuple[int, list[str]]:
    """case -> (ranks, torchtitan's command-line keys): what the worker's trainer is given.
    case: bench/train_step.py's grammar on the bases torchtitan has: 1gpu, dp2_ep2 (its FSDP2
    over 2 ranks with its expert parallelism borrowing them)."""
    base, mods = parse_case(case)
    if base not in ("1gpu", "dp2_ep2"):
        raise ValueError(f"case {case!r}: torchtitan runs 1gpu or dp2_ep2")
    if mods["fp8"] or mods["load_balance"] not in (None, "aux_free"):
        raise ValueError(f"case {case!r}: torchtitan's side runs bf16 experts and its aux-free bias")
    nproc = 1 if base == "1gpu" else 2
    batch = mods["batch"] or a.local_batch
    train_args = [
        "--model.name",
        spec_name(a.family, a.proxy),
        "--model.flavor",
        a.proxy,
        "--training.dataset",
        "stdlib",
        "--training.seq_len",
        str(a.seq_len),
        "--training.local_batch_size",
        str(batch),
        "--training.global_batch_size",
        str(batch * nproc * mods["accum"]),
        "--training.steps",
        str(a.steps),
        "--training.mixed_precision_param",
        a.param_dtype,
        "--metrics.log_freq",
        "1",
        "--metrics.disable_color_printing",
        "--optimizer.lr",
        "3e-4",
        "--lr_scheduler.warmup_steps",
        "2",
        "--activation_checkpoint.mode",
        "none",
        "--job.dump_folder",
        os.path.join(a.work_dir, f"torchtitan_{case}"),
    ]
    if nproc == 2:
        train_args += ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]
    if mods["compiled"]:
        train_args += ["--compile.enable"]
    if mods["bf16params"]:
        # bf16 parameters, no autocast: like titan_fold's *_bf16params cases
        train_args += ["--training.dtype", "bfloat16"]
    return nproc, train_args


def run_case(case: str, a) -> dict:
    nproc, train_args = torchtitan_args(case, a)
    dump = os.path.join(a.work_dir, f"torchtitan_{case}")
    os.makedirs(dump, exist_ok=True)
    if os.path.exists(os.path.join(dump, "metrics.jsonl")):
        os.remove(os.path.join(dump, "metrics.jsonl"))
    launch = [
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(a.port),
        "bench/vs_torchtitan.py",
        "--worker",
        "--family",
        a.family,
        "--proxy",
        a.proxy,
        "--",
    ] + train_args
    cmd = [sys.executable, "-m", "torch.distributed.run"] + launch
    env = dict(os.environ)
    if a.gpus:
        env["CUDA_VISIBLE_DEVICES"] = a.gpus
    env.setdefault("PYTHONUNBUFFERED", "1")
    shown = " ".join(shlex.quote(c) for c in ["torchrun"] + launch)
    print(f"[vs_torchtitan] {case}: {shown}", flush=True)
    log_path = os.path.join(a.work_dir, f"torchtitan_{case}.log")
    with open(log_path, "w") as log:
        rc = run_group(cmd, env, log, a.case_timeout)
    row = {
        "case": case,
        "returncode": rc,
        "command": shown,
        **summarize(read_jsonl(os.path.join(dump, "metrics.jsonl")), a.warmup_steps),
    }
    return finish_row("vs_torchtitan", row, log_path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="1gpu_eager,1gpu_compiled")
    p.add_argument("--family", default="qwen2_moe")
    p.add_argument(
        "--proxy",
        default="57B-A14B-L2",
        help="titan_fold's proxy flavor: torchtitan's model takes its widths; titan_fold's FLOP count",
    )
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--param-dtype", default="bfloat16")
    p.add_argument("--gpus", default=None)
    p.add_argument("--port", type=int, default=29521)
    p.add_argument("--case-timeout", type=int, default=420)
    p.add_argument("--work-dir", default="/tmp/titan_fold_bench")
    p.add_argument("--ours", default=None, help="bench/train_step.py result JSON with rows of the same case names")
    p.add_argument("--name", default="vs_torchtitan")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--worker", action="store_true")
    return p


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    if "--worker" in argv:
        split = argv.index("--")
        a = p.parse_args(argv[:split])
        worker(argv[split + 1 :], a.family, a.proxy)
        return {}
    a = p.parse_args(argv)
    from bench.common import command_line, env_info, write_result
    from titan_fold.trainer.metrics import peak_flops

    fpt = our_flops_per_token(a.family, a.proxy, a.seq_len)
    peak = peak_flops(env_info()["device"])
    rows = []
    ours = {}
    if a.ours and os.path.exists(a.ours):
        with open(a.ours) as f:
            ours = {r["case"]: r for r in json.load(f)["figures"]["rows"]}
    for case in a.cases.split(","):
        row = run_case(case, a)
        tps = row["tokens_per_sec_per_gpu"]
        row["mfu_pct_titan_fold_formula"] = 100 * fpt * tps / peak if tps and peak == peak else None
        # the same run of ours, profiled or not (the profiler traces one step of the median's ten)
        mine = next((r for name, r in ours.items() if _unprofiled(name) == _unprofiled(case)), None)
        if mine and mine.get("tokens_per_sec_per_gpu") and tps:
            row["titan_fold_tokens_per_sec"] = mine["tokens_per_sec_per_gpu"]
            row["titan_fold_mfu_pct"] = mine.get("mfu_pct")
            row["ratio_titan_fold_over_torchtitan"] = mine["tokens_per_sec_per_gpu"] / tps
        rows.append(row)
    figures = {
        "family": a.family,
        "titan_fold_proxy": a.proxy,
        "seq_len": a.seq_len,
        "local_batch": a.local_batch,
        "steps": a.steps,
        "warmup_steps": a.warmup_steps,
        "titan_fold_flops_per_token": fpt,
        "peak_flops": peak,
        "ours_file": a.ours,
        "rows": rows,
    }
    write_result(a.name, figures, a.out_dir, command=command_line(["bench/vs_torchtitan.py"] + argv))
    return figures


if __name__ == "__main__":
    main()
