"""The order of the overlapped micro-batches' pieces (moe.ep_overlap = "batch_wgrad"), from a torch profiler
trace on CPU ranks (gloo): `python bench/overlap_trace.py [--out DIR] [--trace FILE]`.

Two gloo ranks run one training step's worth of gradient accumulation (2 micro-batches) of a
small Qwen2-MoE (3 layers, the first dense; ep 2, the experts' weight gradients split) through
parallel/overlap.py under torch.profiler. It prints rank 0's pieces from micro-batch 0's
backward head to micro-batch 1's forward head in the order they ran, each all-to-all marked
where it is issued and each piece marked that waits for one (where its result is read), and
writes that order with the command, torch version and date to DIR/overlap_trace_cpu.json
(default bench/results), the Chrome trace to FILE when given (open it in Perfetto). On the
CPU the order is what this shows: timings on 2 shared cores say nothing about a GPU.
"""

import argparse
import dataclasses
import datetime
import json
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
MICRO_BATCHES = 2


def build(ep_mesh):
    from titan_fold.models import FLAVORS, Transformer
    from titan_fold.parallel.experts import shard_moe

    args = FLAVORS["qwen2_moe"]["debug"]
    args = dataclasses.replace(
        args, n_layers=3, first_k_dense=1, moe=dataclasses.replace(args.moe, ep_overlap="batch_wgrad")
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    for block in model.layers.values():
        if block.moe_enabled:
            shard_moe(block.moe, ep_mesh)
    return model


def pieces(events) -> list[str]:
    """The schedule's labels in start order; a piece inside which an all-to-all is waited for
    (a functional collective's wait_tensor) is marked."""
    labels = sorted((e for e in events if e.name.startswith("overlap:")), key=lambda e: e.time_range.start)
    waits = [e.time_range.start for e in events if "wait_tensor" in e.name]
    out = []
    for e in labels:
        name = e.name.removeprefix("overlap:")
        if name.endswith("a2a"):
            name += "  (issued)"
        elif any(e.time_range.start <= t <= e.time_range.end for t in waits):
            name += "  (waits for an a2a)"
        out.append(name)
    return out


def worker(rank, port, out_dir, trace):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    from torch.distributed.device_mesh import init_device_mesh

    from titan_fold.parallel.overlap import OverlapSchedule

    model = build(init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))["ep"])
    schedule = OverlapSchedule(model, MICRO_BATCHES)
    g = torch.Generator().manual_seed(rank)
    data = [
        (torch.randint(0, 512, (2, 64), generator=g), torch.randint(0, 512, (2, 64), generator=g))
        for _ in range(MICRO_BATCHES)
    ]

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for tokens, labels in data:
            schedule.step(tokens, labels, loss_fn)
    if rank == 0:
        order = pieces(prof.events())
        pair = order[order.index("mb0 backward head") : order.index("mb1 forward head") + 1]
        if trace:
            prof.export_chrome_trace(trace)
        summary = {
            "command": " ".join(["python bench/overlap_trace.py", *sys.argv[1:]]),
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "device": "CPU, gloo, 2 ranks",
            "pair_order": pair,
        }
        with open(os.path.join(out_dir, "overlap_trace_cpu.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print("\n".join(pair))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--trace", help="write the Chrome trace of rank 0 here")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, args.out, args.trace), nprocs=WORLD, join=True, start_method="fork")


if __name__ == "__main__":
    main()
