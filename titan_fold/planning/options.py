"""The options of `python -m titan_fold.layout` and `python -m titan_fold.plan`, importable
without torch: `--help` and a usage error answer before the planning's imports."""

import argparse

# the activation recompute choices the cost model prices (cost_model.py)
RECOMPUTE = ("none", "selective", "full")


def layout_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titan_fold.layout",
        description="`python -m titan_fold.layout`: print the folded attention and expert groups of a layout.",
    )
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1, help="-1 (default): what the other degrees leave")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--edp", type=int, default=-1, help="-1 (default): derived")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--format", choices=("table", "json", "png"), default="table")
    p.add_argument("--out", default=None, help="file to write (png needs it; default layout.png)")
    p.add_argument(
        "--model",
        default=None,
        help="family/flavor (or a unique flavor), e.g. qwen2_moe/57B-A14B: check the degrees against its sizes",
    )
    p.add_argument("--seq-len", type=int, default=None, help="with --model: check the sequence-length divisibilities")
    p.add_argument("--placements", action="store_true", help="print where each parameter of --model lives")
    p.add_argument(
        "--pp-schedule",
        default="1F1B",
        help="with --placements and --pp > 1: the schedule whose default stage split is printed",
    )
    p.add_argument(
        "--hot-expert-replicas",
        type=int,
        default=0,
        metavar="R",
        help="with --placements: copies of hot experts (moe.hot_expert_replicas), whose gradients the plan shows",
    )
    return p


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titan_fold.plan",
        description="`python -m titan_fold.plan`: rank the folded parallel mappings of a model on a cluster.",
    )
    p.add_argument("--model", required=True, help='"family/flavor" or a unique flavor name, e.g. 57B-A14B')
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step")
    p.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU inside a node")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU between nodes")
    p.add_argument("--tflops", type=float, default=989.0, help="peak bf16 TFLOP/s per GPU")
    p.add_argument("--compute-efficiency", type=float, default=0.6)
    p.add_argument(
        "--gemm-half-rows",
        type=float,
        default=128.0,
        help="GEMM rows at which efficiency halves (small expert GEMMs, short CP chunks)",
    )
    p.add_argument("--comm-efficiency", type=float, default=0.7)
    p.add_argument("--reserve-gib", type=float, default=4.0, help="memory kept for CUDA/NCCL/fragmentation")
    p.add_argument("--capacity-factor", type=float, default=None, help="token drop; unset = dropless")
    p.add_argument(
        "--optimizer",
        choices=("AdamW", "Muon"),
        default="AdamW",
        help="Muon: one momentum state, and its Newton-Schulz and exchanges in the step time",
    )
    p.add_argument("--recompute", nargs="+", choices=RECOMPUTE, default=list(RECOMPUTE))
    p.add_argument("--top", type=int, default=5)
    p.add_argument(
        "--placements",
        action="store_true",
        help="also print where each parameter lives under the best mapping (tp / ep / etp, FSDP)",
    )
    p.add_argument("--write-config", default=None, metavar="FILE.toml", help="job config of the best mapping")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument(
        "--fix",
        nargs="+",
        default=[],
        metavar="DIM=N",
        help="search only mappings with these degrees, e.g. pp=1 or tp=2",
    )
    p.add_argument(
        "--mapping",
        action="append",
        default=[],
        metavar="DIM=N,...",
        help="also estimate this mapping (e.g. pp=4,tp=2,ep=4,etp=1; unset dims: dp_replicate 1, "
        "others derived or 1), with the best recompute choice; unfolded ones also with the "
        "legacy group order; repeatable",
    )
    p.add_argument(
        "--min-gpus",
        nargs="+",
        default=None,
        metavar="DIM=N",
        help="fewest GPUs with these degrees (e.g. cp=8 ep=8), folded vs legacy",
    )
    p.add_argument(
        "--load-profile",
        default=None,
        metavar="FILE",
        help="a run's expert_load.jsonl (--metrics.expert_load): estimate with its last record's "
        "load per ep rank (contiguous expert blocks) instead of a balanced router",
    )
    p.add_argument(
        "--hot-expert-replicas",
        type=int,
        default=0,
        metavar="R",
        help="with --load-profile: also estimate the shown mappings with R copies of the busiest "
        "experts per layer (moe.hot_expert_replicas)",
    )
    return p
