"""The options of `python -m titan_fold.hf` and `python -m titan_fold.upcycle`, importable
without torch: `--help` and a usage error answer before the conversion's imports."""

import argparse

# export's --dtype choices: torch dtypes of these names (checkpoint/hf.py)
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def hf_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m titan_fold.hf",
        description="Convert between Hugging Face safetensors folders and DCP checkpoints on one process.",
    )
    parser.add_argument("direction", choices=["import", "export"])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--model.name", dest="name", help="qwen2_moe, qwen3_moe, mixtral or deepseek_v3")
    parser.add_argument("--model.flavor", dest="flavor", help="a packaged flavor, or hf (needs --model.hf_config)")
    parser.add_argument("--model.hf_config", dest="hf_config", help="config.json or HF folder (with --model.flavor hf)")
    parser.add_argument(
        "--mtp.num_layers",
        dest="mtp_layers",
        type=int,
        default=0,
        help="deepseek_v3: Multi-Token Prediction layers to import / export (default 0: skipped)",
    )
    parser.add_argument("--dtype", choices=DTYPE_NAMES, help="export: cast the tensors (default: as saved)")
    parser.add_argument("--max_shard_size", default="5GB", help="export: largest safetensors file (default 5GB)")
    return parser


def upcycle_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m titan_fold.upcycle",
        description="Upcycling: a dense checkpoint becomes the starting point of an MoE model.",
    )
    parser.add_argument("--dense", required=True, help="dense DCP checkpoint folder (or HF folder with --hf)")
    parser.add_argument("--hf", action="store_true", help="--dense is a Hugging Face safetensors folder")
    parser.add_argument("--out", required=True, help="output DCP folder (model only)")
    parser.add_argument("--model.name", dest="name", required=True, help="qwen2_moe, qwen3_moe or mixtral")
    parser.add_argument("--model.flavor", dest="flavor", required=True, help="a packaged flavor, or hf")
    parser.add_argument(
        "--model.hf_config", dest="hf_config", help="with --model.flavor hf: the MoE model's config.json"
    )
    parser.add_argument("--granularity", type=int, default=1)
    parser.add_argument(
        "--router_std",
        type=float,
        default=None,
        help="std of the router rows; default 0.02 for routers that renormalize the top-k "
        "(exact), 0.01 / sqrt(dim) otherwise (about 1%% off the dense model)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser
