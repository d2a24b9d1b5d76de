"""The GPU benchmarks as named suites: `python -m bench SUITE`.

Each suite runs its steps (the scripts beside this file, each in a process of its own with a
time limit) and writes ONE file, bench/results/<suite>_<gpu>_<date>.json, holding the suite's
command, the machine (GPU, torch, CUDA, NCCL), the date, and per step the script's command and
every figure it measured. `python -m bench.report` turns the latest file of each suite and
machine into docs/benchmarks.md's tables.

    python -m bench --help                     # the suites
    python -m bench layer                      # one suite on this machine's GPU(s)
    python -m bench trainer --base ../before   # and, interleaved, the same steps in a checkout
                                               # of the code before (steps named <step>@base)
    python -m bench trainer --base ../before --base-last   # this code's step first in each pair
    python -m bench layer --steps layer_coarse --shapes mixtral_8x22b   # a step narrowed (also --cases, --impls)

The trainer suites need torchtitan 0.2.2 and its data packages; on a GPU machine without
network carry them as wheels (bench/wheels.sh says how).
"""

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from bench.common import RESULTS_DIR, env_info  # noqa: E402

QWEN3 = ["--family", "qwen3_moe", "--proxy", "30B-A3B-L12"]
QWEN2 = ["--family", "qwen3_moe", "--proxy", "57B-A14B-L2"]
DSV3 = ["--family", "deepseek_v3", "--proxy", "16B-L4"]
FINE, COARSE = "qwen3_30b_a3b,mixtral_8x22b_g8t8", "qwen2_57b_a14b,mixtral_8x22b"
TRAIN_CASES = "1gpu_bf16params_auxfree,1gpu_bf16params_auxfree_compiled"
# the Qwen3-30B-A3B proxy also with compile.cudagraphs, one eager and one compiled step profiled, and
# both with metrics.step_phases (host and GPU time of each phase of every step, no profiler)
TRAIN_EXTRA = (
    "1gpu_bf16params_auxfree_compiled_cudagraphs,1gpu_bf16params_auxfree_profile,"
    "1gpu_bf16params_auxfree_compiled_profile,1gpu_bf16params_auxfree_phases,"
    "1gpu_bf16params_auxfree_compiled_phases"
)
# the coarse proxy compiled with torch's grouped GEMMs too: QuACK (what "auto" picks there) must not be slower
COARSE_TORCH_GEMM = "1gpu_bf16params_auxfree_compiled_torchgemm"
# dp2 x ep2: the exact exchange (split sizes to the host in every layer) beside the static one (worst-case
# blocks, no host sync) eager, with paged stashing (1M rows: 12 layers of 8192 tokens x top-8 with a third
# to spare for imbalance), compiled (also with the stash) and captured in CUDA graphs
DP2_EP2 = "dp2_ep2_bf16params_auxfree"
STASH = "_stash1048576"
STATIC_CASES = ",".join(
    DP2_EP2 + m
    for m in (
        "",
        "_static",
        "_static" + STASH,
        "_compiled",
        "_compiled_static",
        "_compiled_static" + STASH,
        "_compiled_static_cudagraphs",
    )
)
EXCHANGE_CASES = ",".join(
    ["1gpu_bf16params_auxfree_compiled"]
    + [
        DP2_EP2 + m
        for m in (
            "_compiled",
            "_compiled_device",
            "_compiled_rerun",
            "_compiled_device_rerun",
            "_compiled_device_profile",
        )
    ]
)
# the foldings of 2 GPUs at one global batch (4 sequences): tp2 x ep2 runs local batch 4 on its one dp
# rank, so each GPU holds the tokens it holds under dp2 x ep2; each folding twice (the spread)
FOLDING_CASES = ",".join(
    f"{base}_bf16params_auxfree_compiled{batch}{rerun}"
    for rerun in ("", "_rerun")
    for base, batch in (("tp2_ep2", "_b4"), ("dp2_ep2", ""), ("dp2_etp2", ""), ("dp2_edp2", ""))
)
# every speed option of the exchange beside the default (exact): the overlap and delayed weight
# gradients eager over 2 micro-batches, the other exchanges compiled, static also in CUDA graphs
OPTION_CASES = ",".join(
    DP2_EP2 + m
    for m in (
        "_ga2",
        "_ga2_overlap",
        "_ga2_overlap_delaywgrad",
        "_compiled",
        "_compiled_static",
        "_compiled_static_cudagraphs",
        "_compiled_device",
    )
)
# copies of hot experts (moe.hot_expert_replicas): a quarter of the experts drawn for half the
# picks (skewed), without copies and with 8 or 16 per layer, beside every expert alike (the
# balanced ideal) without and with 16: what the copies recover, and what they cost when balanced
REPLICA_CASES = ",".join(
    DP2_EP2 + "_compiled" + m
    for m in ("_skew", "_skew_replicas8", "_skew_replicas16", "_uniform", "_uniform_replicas16", "_skew_rerun")
)
# a real run's routing (aux-free balancing) from the first step, without and with copies
REPLICA_RUN = f"{DP2_EP2}_compiled,{DP2_EP2}_compiled_replicas16"
# Muon beside fused AdamW, each step's phases timed: one GPU over 200 steps (the loss curves,
# `python -m bench.curves`), then dp2 x ep2
MUON_CURVES = "1gpu_bf16params_auxfree_compiled_phases,1gpu_bf16params_auxfree_compiled_phases_muon"
MUON_DP2_EP2 = "dp2_ep2_bf16params_auxfree_compiled_phases,dp2_ep2_bf16params_auxfree_compiled_phases_muon"
# dp2 x ep2 compiled with torch's grouped GEMMs (exact and static exchange) beside QuACK's (installed:
# bench/wheels.sh), which need the static exchange's fixed row count, also captured in CUDA graphs
QUACK_CASES = ",".join(
    DP2_EP2 + m
    for m in (
        "_compiled_torchgemm",
        "_compiled_static_torchgemm",
        "_compiled_static_quack",
        "_compiled_static_cudagraphs_quack",
    )
)
# seconds for a titan_fold trainer step of eager and compiled cases where QuACK is installed: on a fresh machine
# its kernels compile in the first case, which takes the Qwen3-30B-A3B proxy's first step minutes
QUACK_COLD = 420
# (step, family, proxy, routings): one EP rank's experts (train_step.register_proxy's -E); with top-8 of
# EP16's 8 experts every token takes them all, so natural and uniform routing are one
FULL_DEPTH = [
    ("qwen3_30b_a3b_ep8", "qwen3_moe", "30B-A3B-E16", ("uniform", None)),
    ("qwen3_30b_a3b_ep16", "qwen3_moe", "30B-A3B-E8", ("uniform",)),
    ("deepseek_v3_16b_ep8", "deepseek_v3", "16B-E8", (None, "uniform")),
]
# (step, family, proxy) of the families suite, each run compiled with bf16 weights
FAMILY_PROXIES = [
    ("qwen3_30b_a3b_l12", "qwen3_moe", "30B-A3B-L12"),
    ("gpt_oss_20b_l6", "gpt_oss", "20b-L6"),
    ("qwen3_5_35b_a3b_l8", "qwen3_5_moe", "35B-A3B-L8"),
]
FAMILY_CASE = "1gpu_bf16params_auxfree_compiled"
# micro-batches of 2 and 4 sequences; each step is 32 sequences: few steps, the first two left out
FULL_DEPTH_STEPS = ["--steps", "6", "--warmup-steps", "2"]
# the fine-grained shapes' eager steps are host-bound: enough repeats that the median is the host's, not a hiccup's
TIMING = ["--warmup", "10", "--iters", "50"]


@dataclass
class Step:
    name: str
    script: str  # bench/<script>.py
    args: list[str]
    timeout: int  # seconds
    gpus: int = 1  # > 1: launched by torchrun with that many processes
    ours: str | None = None  # vs_torchtitan: the step whose titan_fold rows sit beside torchtitan's


@dataclass
class Suite:
    help: str
    steps: list[Step] = field(default_factory=list)


SUITES = {
    "layer": Suite(
        "1 GPU: one MoE layer forward + backward at every shape of bench/moe_layer.py with moe.expert_kernels torch "
        "and quack, each beside the dense GEMM rate: the fine-grained shapes eager, compiled and captured in a CUDA "
        "graph, the coarse ones eager; profiled eager and captured steps at Qwen3-30B-A3B shapes (kernel classes, "
        "the GPU's idle time)",
        [
            Step(
                "layer_fine",
                "moe_layer",
                [
                    "--impl",
                    "titan_fold,titan_fold_quack",
                    "--modes",
                    "dropless",
                    "--shapes",
                    FINE,
                    "--compile",
                    "all",
                    "--no-profile",
                    *TIMING,
                ],
                400,
            ),
            Step(
                "layer_coarse",
                "moe_layer",
                [
                    "--impl",
                    "titan_fold,titan_fold_quack",
                    "--modes",
                    "dropless",
                    "--shapes",
                    COARSE,
                    "--compile",
                    "off",
                    "--no-profile",
                    *TIMING,
                ],
                900,
            ),
            Step(
                "layer_profile",
                "moe_layer",
                [
                    "--impl",
                    "titan_fold,titan_fold_quack",
                    "--modes",
                    "dropless",
                    "--shapes",
                    "qwen3_30b_a3b",
                    "--compile",
                    "off_graph",
                    *TIMING,
                ],
                240,
            ),
        ],
    ),
    "trainer": Suite(
        "1 GPU: the trainer on the Qwen3-MoE proxies (Qwen3-30B-A3B widths, 12 layers; Qwen2-57B-A14B widths, "
        "2 layers), bf16 weights, aux-free balancing, eager and compiled; the first also compiled with CUDA graphs "
        "and one profiled eager and compiled step each (GPU time by kernel class), eager and compiled with each step's "
        "phases timed, the second also compiled with torch's grouped GEMMs",
        [
            Step(
                "qwen3_30b_a3b_l12",
                "train_step",
                [*QWEN3, "--cases", TRAIN_CASES + "," + TRAIN_EXTRA, "--steps", "15"],
                600,
            ),
            Step(
                "qwen2_57b_a14b_l2",
                "train_step",
                [*QWEN2, "--cases", TRAIN_CASES + "," + COARSE_TORCH_GEMM, "--steps", "15"],
                300,
            ),
        ],
    ),
    "vs-torchtitan": Suite(
        "1 GPU: the trainer suite's Qwen3-MoE proxies in titan_fold and in torchtitan 0.2.2, side by side",
        [
            Step("qwen3_30b_a3b_l12", "train_step", [*QWEN3, "--cases", TRAIN_CASES, "--steps", "15"], QUACK_COLD),
            Step(
                "torchtitan_qwen3_30b_a3b_l12",
                "vs_torchtitan",
                [*QWEN3, "--cases", TRAIN_CASES, "--steps", "15"],
                200,
                ours="qwen3_30b_a3b_l12",
            ),
            Step("qwen2_57b_a14b_l2", "train_step", [*QWEN2, "--cases", TRAIN_CASES, "--steps", "15"], QUACK_COLD),
            Step(
                "torchtitan_qwen2_57b_a14b_l2",
                "vs_torchtitan",
                [*QWEN2, "--cases", TRAIN_CASES, "--steps", "15"],
                200,
                ours="qwen2_57b_a14b_l2",
            ),
        ],
    ),
    "rl": Suite(
        "1 GPU: routing replay against a real mismatch: the Qwen3-MoE proxy (Qwen3-30B-A3B widths, 4 layers) "
        "sampled by transformers in bf16, its log-probs in titan_fold compiled with bf16 weights without and with "
        "moe.routing_replay = 'rollout', and the policy step's time of each (needs transformers: bench/wheels.sh)",
        [Step("replay_mismatch", "replay_mismatch", [], 500)],
    ),
    "gdn": Suite(
        "1 GPU: Qwen3.5-35B-A3B's Gated DeltaNet layer beside its gated full-attention layer, forward + backward, "
        "bf16, compiled, at 4K (batch 2) and 32K (batch 1); the linear attention on fla's kernels (the gdn extra: "
        "bench/wheels.sh)",
        [Step("gdn_35b_a3b", "gdn", [], 500)],
    ),
    "families": Suite(
        "1 GPU: a proxy of each family beside the Qwen3-30B-A3B one (12 layers), compiled, bf16 weights, local "
        "batch 2 at 4K: GPT-OSS-20B's widths at 6 layers (sliding and full attention with sinks: about the Qwen3 "
        "proxy's FLOPs per token) and Qwen3.5-35B-A3B's at 8 layers (6 Gated DeltaNet, 2 gated full attention; fla's "
        "kernels: bench/wheels.sh); MFU in titan_fold's and torchtitan's counts",
        [
            Step(
                name, "train_step", ["--family", family, "--proxy", proxy, "--cases", FAMILY_CASE, "--steps", "15"], 420
            )
            for name, family, proxy in FAMILY_PROXIES
        ],
    ),
    "deepseek-v3": Suite(
        "1 GPU: the DeepSeek-V3 16B proxy (its widths, 4 layers) in titan_fold and in torchtitan 0.2.2's "
        "deepseek_v3, side by side, eager and compiled",
        [
            Step("deepseek_v3_16b_l4", "train_step", [*DSV3, "--cases", TRAIN_CASES, "--steps", "15"], QUACK_COLD),
            Step(
                "torchtitan_deepseek_v3_16b_l4",
                "vs_torchtitan",
                [*DSV3, "--cases", TRAIN_CASES, "--steps", "15"],
                240,
                ours="deepseek_v3_16b_l4",
            ),
        ],
    ),
    "loss-curve": Suite(
        "1 GPU: the Qwen3-30B-A3B proxy 200 steps with moe.expert_kernels torch, then quack, then each again "
        "(compiled): the two paths' difference beside each path's run-to-run spread; with the aux-free bias "
        "(the trainer suite's balancing) and with the aux loss",
        [
            Step(
                f"qwen3_30b_a3b_l12_200{suffix}",
                "train_step",
                [
                    *QWEN3,
                    "--cases",
                    ",".join(
                        f"1gpu_bf16params_{balance}_compiled_{path}"
                        for path in ("torchgemm", "quack", "torchgemm_rerun", "quack_rerun")
                    ),
                    "--steps",
                    "200",
                    "--warmup-steps",
                    "10",
                ],
                560,
            )
            for balance, suffix in (("auxfree", ""), ("auxloss", "_auxloss"))
        ],
    ),
    "full-depth": Suite(
        "1 GPU: the work one GPU does in the published EP runs, at full depth: Qwen3-30B-A3B's 48 layers "
        "with one EP8 rank's 16 experts and one EP16 rank's 8, DeepSeek-V3-16B's 27 layers with one EP8 "
        "rank's 8; 32 sequences of 4096 tokens per step (Megatron-Bridge's 512 over 16 GPUs), routing "
        "forced uniform (_uniform) and natural; TFLOP/s in Megatron's, titan_fold's and torchtitan's "
        "counts in bench.report's table 'comparable with published runs'",
        [
            Step(
                f"{name}_{routing or 'natural'}",
                "train_step",
                [
                    "--family",
                    family,
                    "--proxy",
                    proxy,
                    "--cases",
                    ",".join(
                        f"1gpu_bf16params_auxfree_compiled{'_' + routing if routing else ''}_{batch}"
                        for batch in ("b2_ga16", "b4_ga8")
                    ),
                    *FULL_DEPTH_STEPS,
                ],
                560,
            )
            for name, family, proxy, routings in FULL_DEPTH
            for routing in routings
        ],
    ),
    "kernels": Suite(
        "1 GPU: the routed grouped GEMMs alone (torch's and QuACK's, rows per expert drawn and equal), the gradient norm, the fp32 master step, row movement, "
        "the router's choice of k (aten's topk, a sort's head, argmax passes) and the grouping's sort, "
        "attention per SDPA backend, packed documents' attention against causal, the planner of copies of hot experts, "
        "the host time per call of the eager path's generated kernels",
        # QuACK compiles and tunes its kernels for every width: the coarse shapes' take minutes on a fresh machine
        [
            Step("grouped_gemm", "grouped_gemm", ["--shapes", f"{FINE},{COARSE}", "--impl", "torch,quack"], 900),
            Step("grad_norm", "grad_norm", [], 90),
            Step("master_step", "master_step", [], 120),
            Step("row_movement", "row_movement", [], 60),
            # three shapes, each eager, compiled and with the token count dynamic: about 30 compilations
            Step("routing", "routing", [], 360),
            Step("attention", "attention", [], 120),
            Step("replicas", "replicas", [], 240),
            Step("documents", "documents", [], 300),
            Step("launch", "launch", [], 120),
        ],
    ),
    "dry-run": Suite(
        "CPU: the dry run of qwen2.toml at 64 ranks as README shows it, without and with the collective check "
        "(the dry run's own CPU seconds, the process's with its imports, wall seconds)",
        [Step("dry_run", "dry_run", ["--configs", "qwen2.toml:64"], 1200)],
    ),
    "2gpu": Suite(
        "2 GPUs: collectives, the MoE layer at ep2 / etp2, trainer foldings, dp2 x ep2 beside torchtitan, "
        "the Qwen3-30B-A3B proxy at dp2 x ep2 with the static exchange (eager, paged stashing, compiled, CUDA graphs) "
        "and with QuACK's grouped GEMMs, its foldings compiled at one global batch (tp2 x ep2, dp2 x ep2, dp2 x etp2, "
        "dp2 x edp2), every exchange option beside the default, Muon beside AdamW (one GPU over 200 steps, and "
        "dp2 x ep2)",
        [
            Step("collectives", "collectives", [], 60, gpus=2),
            Step("layer_ep2_etp2", "moe_layer", ["--dispatch", "ep2,etp2", "--compile", "off"], 100, gpus=2),
            Step(
                "foldings",
                "train_step",
                ["--cases", "dp2_ep2,dp2_etp2,dp2_edp2,tp2_ep2,tp2_etp2,pp2", "--steps", "15"],
                480,
            ),
            Step(
                "qwen3_30b_a3b_l12_dp2_ep2",
                "train_step",
                [*QWEN3, "--cases", "dp2_ep2_bf16params_auxfree", "--steps", "15"],
                200,
            ),
            Step(
                "torchtitan_qwen3_30b_a3b_l12_dp2_ep2",
                "vs_torchtitan",
                [*QWEN3, "--cases", "dp2_ep2_bf16params_auxfree", "--steps", "15"],
                200,
                ours="qwen3_30b_a3b_l12_dp2_ep2",
            ),
            Step(
                "qwen3_30b_a3b_l12_dp2_ep2_static",
                "train_step",
                [*QWEN3, "--cases", STATIC_CASES, "--steps", "15", "--case-timeout", "200"],
                1200,
            ),
            # the exchanges side by side, each twice (the spread), beside one GPU: moe.exchange (docs/moe.md)
            Step(
                "qwen3_30b_a3b_l12_dp2_ep2_exchange",
                "train_step",
                [*QWEN3, "--cases", EXCHANGE_CASES, "--steps", "12", "--warmup-steps", "4", "--case-timeout", "150"],
                900,
            ),
            Step(
                "qwen3_30b_a3b_l12_foldings",
                "train_step",
                [*QWEN3, "--cases", FOLDING_CASES, "--steps", "10", "--warmup-steps", "4", "--case-timeout", "100"],
                900,
            ),
            Step(
                "qwen3_30b_a3b_l12_dp2_ep2_options",
                "train_step",
                [*QWEN3, "--cases", OPTION_CASES, "--steps", "10", "--warmup-steps", "4", "--case-timeout", "110"],
                900,
            ),
            Step(
                "qwen3_30b_a3b_l12_dp2_ep2_replicas",
                "train_step",
                [*QWEN3, "--cases", REPLICA_CASES, "--steps", "12", "--warmup-steps", "4", "--case-timeout", "150"],
                900,
            ),
            Step(
                "qwen3_30b_a3b_l12_dp2_ep2_replicas_200",
                "train_step",
                [*QWEN3, "--cases", REPLICA_RUN, "--steps", "200", "--warmup-steps", "10", "--case-timeout", "400"],
                840,
            ),
            Step(
                "qwen3_30b_a3b_l12_muon_200",
                "train_step",
                [*QWEN3, "--cases", MUON_CURVES, "--steps", "200", "--warmup-steps", "10", "--case-timeout", "270"],
                600,
            ),
            Step(
                "qwen3_30b_a3b_l12_dp2_ep2_muon",
                "train_step",
                [*QWEN3, "--cases", MUON_DP2_EP2, "--steps", "10", "--warmup-steps", "4", "--case-timeout", "110"],
                300,
            ),
            Step(
                "qwen3_30b_a3b_l12_dp2_ep2_quack",
                "train_step",
                [*QWEN3, "--cases", QUACK_CASES, "--steps", "15", "--case-timeout", "300"],
                900,
            ),
        ],
    ),
}


def gpu_tag(env: dict) -> str:
    """'h100', 'h200', ... (x<count> for several GPUs); 'cpu' without one."""
    name = env["device"].lower()
    tag = next((t for t in ("h100", "h200", "b200", "a100") if t in name), "cpu" if not env["device_count"] else "gpu")
    return tag + (f"x{env['device_count']}" if env["device_count"] > 1 else "")


# the lists a step's script takes that `python -m bench` can narrow: its flag there -> the script's flag
LISTS = {"cases": "--cases", "shapes": "--shapes", "impls": "--impl"}


def narrowed(args: list[str], wanted: dict[str, list[str] | None] | None) -> list[str] | None:
    """A step's arguments with each list named in `wanted` (LISTS' keys -> the entries asked for,
    None: all) cut to those entries, in the step's own order; a step without that list runs
    whole. None when a list is left empty: the step has nothing asked for."""
    for key, kept in (wanted or {}).items():
        flag = LISTS[key]
        if kept is None or flag not in args:
            continue
        i = args.index(flag) + 1
        entries = [e for e in args[i].split(",") if e in kept]
        if not entries:
            return None
        args = [*args[:i], ",".join(entries), *args[i + 1 :]]
    return args


def step_command(
    step: Step, out_dir: str, name: str, ours_path: str | None = None, wanted: dict[str, list[str] | None] | None = None
) -> list[str]:
    args = narrowed(step.args, wanted)
    cmd = [sys.executable, os.path.join("bench", f"{step.script}.py"), *args, "--name", name, "--out-dir", out_dir]
    if step.gpus > 1 and step.script in ("moe_layer", "collectives"):  # these are the workers themselves
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(step.gpus),
            "--master_port",
            "29541",
            *cmd[1:],
        ]
    if ours_path:
        cmd += ["--ours", ours_path]
    return cmd


def run_step(
    step: Step, root: str, out_dir: str, name: str, ours_path: str | None, wanted: dict[str, list[str] | None] | None
) -> dict:
    """Runs one step in the checkout `root`, its lists narrowed to `wanted`; -> {command, returncode, figures}."""
    cmd = step_command(step, out_dir, name, ours_path, wanted)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    shown = " ".join(shlex.quote(c) for c in ["python", *cmd[1:]])
    print(f"[bench] {name}: {shown}", flush=True)
    start = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=root, env=env, timeout=step.timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    path = os.path.join(out_dir, f"{name}.json")
    figures = json.load(open(path))["figures"] if os.path.exists(path) else None
    return {"command": shown, "returncode": rc, "wall_s": round(time.monotonic() - start, 1), "figures": figures}


def run_suite(
    suite_name: str,
    steps: list[str] | None,
    base: str | None,
    out_dir: str,
    wanted: dict[str, list[str] | None] | None = None,
    base_last: bool = False,
) -> str:
    suite = SUITES[suite_name]
    env = env_info()
    date = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "suite": suite_name,
        "command": "python -m bench " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date_utc": date.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "env": env,
        "figures": {},
        "steps": {},
    }
    path = os.path.join(out_dir, f"{suite_name}_{gpu_tag(env)}_{date.strftime('%Y-%m-%d')}.json")
    if os.path.exists(path):  # an earlier run of the day stays: this one's name gets the time
        path = path[: -len(".json")] + date.strftime("_%H%M") + ".json"
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for step in suite.steps:
            if steps and step.name not in steps or narrowed(step.args, wanted) is None:
                continue
            # interleaved, on the same warm machine: code before first, then this code (base_last: the
            # other way round; processes differ by a percent or two, pairs in both orders tell order from change)
            order = ([("@base", os.path.abspath(base))] if base else []) + [("", ROOT)]
            for tag, root in reversed(order) if base_last else order:
                ours = os.path.join(tmp, f"{step.ours}{tag}.json") if step.ours else None
                result = run_step(step, root, tmp, step.name + tag, ours, wanted)
                record["figures"][step.name + tag] = result.pop("figures")
                record["steps"][step.name + tag] = result
                with open(path, "w") as f:  # after every step: a cut-off run keeps what it had
                    json.dump(record, f, indent=1)
                    f.write("\n")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run one benchmark suite; write bench/results/<suite>_<gpu>_<date>.json.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="suites:\n" + "\n".join(f"  {n:14s}{s.help}" for n, s in SUITES.items()),
    )
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--steps", default=None, help="comma list: run only these steps of the suite")
    p.add_argument("--cases", default=None, help="comma list: of the trainer steps' cases, run only these")
    p.add_argument(
        "--shapes",
        default=None,
        help="comma list: of the MoE-layer steps' shapes, run only these "
        "(e.g. one coarse shape, whose QuACK tuning alone takes minutes)",
    )
    p.add_argument(
        "--impls",
        default=None,
        help="comma list: of the MoE-layer steps' implementations "
        "(titan_fold: torch's grouped GEMMs, titan_fold_quack), run only these",
    )
    p.add_argument(
        "--base",
        default=None,
        help="a checkout of the code before: each step runs there first, then here (results <step>@base and <step>)",
    )
    p.add_argument(
        "--base-last", action="store_true", help="with --base: each step runs here first, then in the code before"
    )
    p.add_argument("--out-dir", default=RESULTS_DIR)
    a = p.parse_args(argv)
    if a.base_last and not a.base:
        p.error("--base-last needs --base")
    wanted = {key: getattr(a, key).split(",") if getattr(a, key) else None for key in LISTS}
    path = run_suite(a.suite, a.steps.split(",") if a.steps else None, a.base, a.out_dir, wanted, a.base_last)
    print(f"[bench] wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
