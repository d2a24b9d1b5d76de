"""Convert between Hugging Face safetensors folders and DCP checkpoints on one process.

    python -m titan_fold.hf import HF_FOLDER DCP_FOLDER --model.name qwen2_moe --model.flavor 57B-A14B
    python -m titan_fold.hf export DCP_FOLDER HF_FOLDER --model.name mixtral --model.flavor 8x7B

import writes a model-only DCP checkpoint: start training from it under any layout with
`--checkpoint.initial_load_path DCP_FOLDER` (DCP reshards on load). export reads the model
tensors of any DCP checkpoint (a step-N folder, full or model-only) and writes
model.safetensors + config.json that transformers' from_pretrained opens. The trainer does
the same in place with `--checkpoint.initial_load_in_hf` / `--checkpoint.last_save_in_hf`;
this tool needs no process group and holds the whole model once in memory.
"""

import argparse
import json
import os

import torch

from titan_fold.checkpoint import compare_shapes, read_hf_folder, read_model_tensors
from titan_fold.errors import run_command
from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.hf_adapter import ADAPTERS, hf_config


def import_hf(hf_folder: str, out: str, name: str, flavor: str) -> None:
    import torch.distributed.checkpoint as dcp

    args = FLAVORS[name][flavor]
    with torch.device("meta"):
        wanted = {k: list(v.shape) for k, v in Transformer(args).state_dict().items()}
    sd = ADAPTERS[name](args, None).from_hf(read_hf_folder(hf_folder))
    # HF has no aux-free router biases: they start at zero, as in a fresh model
    sd.update({k: torch.zeros(shape) for k, shape in wanted.items() if k.endswith("router.expert_bias")})
    compare_shapes(f"Hugging Face checkpoint {hf_folder}", {k: list(v.shape) for k, v in sd.items()}, wanted)
    dcp.save(sd, checkpoint_id=out)


def export_hf(dcp_folder: str, out: str, name: str, flavor: str) -> None:
    from safetensors.torch import save_file

    args = FLAVORS[name][flavor]
    sd = read_model_tensors(dcp_folder)
    with torch.device("meta"):
        wanted = {k: list(v.shape) for k, v in Transformer(args).state_dict().items()}
    compare_shapes(f"checkpoint {dcp_folder}", {k: list(v.shape) for k, v in sd.items()}, wanted)
    hf = {k: v.contiguous() for k, v in ADAPTERS[name](args, None).to_hf(sd).items()}
    os.makedirs(out, exist_ok=True)
    save_file(hf, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(name, args), f, indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("direction", choices=["import", "export"])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--model.name", dest="name", required=True, choices=sorted(FLAVORS))
    parser.add_argument("--model.flavor", dest="flavor", required=True)
    a = parser.parse_args(argv)
    if a.flavor not in FLAVORS[a.name]:
        parser.error(f"--model.flavor {a.flavor!r}: {a.name} has {sorted(FLAVORS[a.name])}")
    (import_hf if a.direction == "import" else export_hf)(a.src, a.dst, a.name, a.flavor)
    print(f"{a.direction}ed {a.src} -> {a.dst}")


if __name__ == "__main__":
    run_command(main)
