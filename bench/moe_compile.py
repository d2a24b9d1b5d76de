"""Eager vs torch.compile time of one MoE layer (forward + backward), with graph breaks.

    python bench/moe_compile.py                        # CPU, small shapes, fp32
    python bench/moe_compile.py --preset qwen2 --out bench/results/moe_compile_h100.json   # GPU, bf16
    torchrun --nproc_per_node 2 bench/moe_compile.py --ep 2   # the EP x ETP dispatcher (ep * etp | ranks)

For each mode (dropless, token drop, pad-to-capacity) it reports eager and compiled
milliseconds per step, the graph breaks found by torch._dynamo.explain, the graphs
compiled during the timed steps after warm-up (recompiles), and whether
fullgraph=True compiles.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from titan_fold.moe import MoE, MoEArgs
from titan_fold.parallel.experts import shard_moe

PRESETS = {
    # tokens per rank, hidden, expert ffn, experts, top-k, shared ffn
    "tiny": dict(tokens=2048, dim=256, ffn=128, experts=8, top_k=2, shared_ffn=256),
    "qwen2": dict(tokens=8192, dim=3584, ffn=2560, experts=64, top_k=8, shared_ffn=20480),
    "mixtral": dict(tokens=8192, dim=6144, ffn=16384, experts=8, top_k=2, shared_ffn=0),
}

MODES = {
    "dropless": dict(token_drop="dropless", capacity_factor=None),
    "drop": dict(token_drop="drop", capacity_factor=1.0),
    "pad": dict(token_drop="drop_and_pad", capacity_factor=1.0),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def log(msg):
    if int(os.environ.get("RANK", 0)) == 0:
        print(msg, file=sys.stderr, flush=True)


def step(layer, x, grad):
    y = layer(x)
    y.backward(grad)


def timed(layer, x, grad, iters, warmup, device):
    for _ in range(warmup):
        step(layer, x, grad)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        step(layer, x, grad)
    sync(device)
    return (time.perf_counter() - t0) / iters * 1e3


def bench_mode(mode, shape, dtype, device, iters, warmup, seq_len, meshes):
    args = MoEArgs(
        num_experts=shape["experts"],
        top_k=shape["top_k"],
        moe_ffn_dim=shape["ffn"],
        shared_ffn_dim=shape["shared_ffn"],
        shared_expert_gate=shape["shared_ffn"] > 0,
        **MODES[mode],
    )
    torch.manual_seed(0)
    layer = MoE(shape["dim"], args).to(device=device, dtype=dtype)
    layer.init_weights(0.02)
    if meshes is not None:
        shard_moe(layer, *meshes)  # every rank holds all tokens' worth of its own batch
    x = torch.randn(shape["tokens"] // seq_len, seq_len, shape["dim"], device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    row = {"mode": mode, "eager_ms": timed(layer, x, grad, iters, warmup, device)}
    # fwd + bwd = 3 x forward; a SwiGLU forward is 3 GEMMs of 2 * dim * ffn per row
    # (dropless work: token-drop modes compute a little less or, padded, a little more)
    row["tflop"] = 18 * shape["tokens"] * shape["dim"] * (shape["top_k"] * shape["ffn"] + shape["shared_ffn"]) / 1e12

    log(f"{mode}: eager {row['eager_ms']:.2f} ms; explain")
    torch._dynamo.reset()
    explain = torch._dynamo.explain(layer)(x)
    row["graphs"] = explain.graph_count
    row["graph_breaks"] = explain.graph_break_count
    row["break_reasons"] = sorted({str(b.reason).splitlines()[0][:120] for b in explain.break_reasons})

    log(f"{mode}: compile")
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    for _ in range(warmup):
        step(compiled, x, grad)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    row["compiled_ms"] = timed(compiled, x, grad, iters, 0, device)
    row["recompiles_after_warmup"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    row["speedup"] = row["eager_ms"] / row["compiled_ms"]
    row["compiled_tflops"] = row["tflop"] / row["compiled_ms"] * 1e3

    log(f"{mode}: fullgraph")
    torch._dynamo.reset()
    try:
        step(torch.compile(layer, fullgraph=True), x, grad)
        row["fullgraph"] = "ok"
    except Exception as e:  # report, do not stop the other modes
        row["fullgraph"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESETS, default=None, help="shapes (default: tiny on CPU, qwen2 on GPU)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--modes", default="dropless,drop,pad")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ep", type=int, default=None, help="under torchrun: expert parallel degree (default: all ranks)")
    p.add_argument("--etp", type=int, default=1, help="under torchrun: expert tensor parallel degree")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world, meshes = int(os.environ.get("WORLD_SIZE", 1)), None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        ep = a.ep or world // a.etp
        mesh = init_device_mesh(device.type, (world // (ep * a.etp), ep, a.etp), mesh_dim_names=("edp", "ep", "etp"))
        meshes = (mesh["ep"] if ep > 1 else None, mesh["etp"] if a.etp > 1 else None)
    preset = a.preset or ("qwen2" if device.type == "cuda" else "tiny")
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = PRESETS[preset]
    seq_len = min(a.seq_len, shape["tokens"])

    rows = [bench_mode(m, shape, dtype, device, a.iters, a.warmup, seq_len, meshes) for m in a.modes.split(",")]
    if world > 1:
        dist.destroy_process_group()
        if int(os.environ["RANK"]) > 0:
            return

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    layout = f"{world} ranks, ep {ep}, etp {a.etp}, tokens per rank" if world > 1 else "1 rank"
    print(f"MoE layer fwd+bwd, {preset} {shape}, {dtype}, {name}, {layout}, torch {torch.__version__}")
    print(
        f"{'mode':<9} {'eager ms':>9} {'compiled ms':>12} {'speedup':>8} {'TFLOP/s':>8} {'graphs':>7} {'breaks':>7} "
        f"{'recomp':>7}  fullgraph"
    )
    for r in rows:
        print(
            f"{r['mode']:<9} {r['eager_ms']:>9.2f} {r['compiled_ms']:>12.2f} {r['speedup']:>8.2f} {r['compiled_tflops']:>8.1f} "
            f"{r['graphs']:>7} {r['graph_breaks']:>7} {r['recompiles_after_warmup']:>7}  {r['fullgraph']}"
        )
        for reason in r["break_reasons"]:
            print(f"{'':<9} break: {reason}")

    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(
                {
                    "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                    "device": name,
                    "layout": layout,
                    "torch": torch.__version__,
                    "preset": preset,
                    "shape": shape,
                    "dtype": str(dtype),
                    "results": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
