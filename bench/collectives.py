"""Achieved bandwidth of the dispatcher's collectives against raw NCCL of the same bytes.

    torchrun --nproc_per_node 2 bench/collectives.py
    torchrun --nproc_per_node 2 bench/collectives.py --smoke      # CPU (gloo), tiny sizes

For each size (the row payloads of the benchmark shapes: tokens x top_k rows of dim bf16,
plus a sweep) it times, with CUDA events and the median after warm-up:
  raw_all_to_all       dist.all_to_all_single, even splits
  dispatcher_a2a_even  titan_fold.moe.rows._a2a (functional, autograd-aware), even splits
  dispatcher_a2a_uneven  the same with the 55/45 split a skewed routing gives
  raw_all_gather       dist.all_gather_into_tensor of the same output bytes
  dispatcher_all_gather_v  dispatcher._all_gather_v (all_to_all of a repeated chunk: gloo has
                       no uneven all-gather, the GPU path uses the same code)
Bandwidth "out" = bytes this rank sends to other ranks / time (a 2-rank all-to-all sends
half its buffer away; an all-gather sends its whole input to each other rank).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import titan_fold.moe.dispatcher as dispatcher_mod  # noqa: E402
import titan_fold.moe.rows as rows_mod  # noqa: E402
from bench.common import median, script_parser, time_ms, write_result  # noqa: E402

# rows of a rank's send buffer (tokens 8192 x top_k) and the hidden size, per benchmark shape
PAYLOADS = {
    "qwen2_57b_a14b": (8192 * 8, 3584),
    "mixtral_8x22b": (8192 * 2, 6144),
    "mixtral_8x22b_g8t8": (8192 * 8, 6144),
    "sweep_8MiB": (1024, 4096),
    "sweep_64MiB": (8192, 4096),
    "sweep_256MiB": (32768, 4096),
    "tiny": (256, 64),
}


def bench_payload(name, rows, dim, mesh, device, a) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    rows -= rows % world
    x = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    even = [rows // world] * world
    skew = [int(rows * 0.55)] + [(rows - int(rows * 0.55)) // (world - 1)] * (world - 1)
    skew[-1] += rows - sum(skew)
    # what each rank receives under the skew: rank r gets skew[r] rows from every rank
    recv_skew = [skew[rank]] * world

    def wait(t):
        return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) or hasattr(t, "wait") else t

    half = x[: rows // world]
    gathered = torch.empty(rows // world * world, dim, device=device, dtype=x.dtype)
    cases = {
        "raw_all_to_all": (lambda: dist.all_to_all_single(out, x), nbytes * (world - 1) / world),
        "dispatcher_a2a_even": (lambda: wait(rows_mod._a2a(x, even, even, mesh)), nbytes * (world - 1) / world),
        "dispatcher_a2a_uneven": (
            lambda: wait(rows_mod._a2a(x, recv_skew, skew, mesh)),
            (nbytes / rows) * (rows - skew[rank]),
        ),
        "raw_all_gather": (lambda: dist.all_gather_into_tensor(gathered, half), half.numel() * 2 * (world - 1)),
        "dispatcher_all_gather_v": (
            lambda: wait(dispatcher_mod._all_gather_v(half, [rows // world] * world, mesh)),
            half.numel() * 2 * (world - 1),
        ),
    }
    row = {"payload": name, "rows": rows, "dim": dim, "buffer_mib": round(nbytes / 2**20, 1)}
    for case, (fn, out_bytes) in cases.items():
        ms = median(time_ms(fn, a.warmup, a.iters, device))
        row[case] = {"median_ms": round(ms, 4), "out_GBps": round(out_bytes / (ms * 1e-3) / 1e9, 2)}
    row["dispatcher_over_raw_a2a"] = round(
        row["raw_all_to_all"]["median_ms"] / row["dispatcher_a2a_even"]["median_ms"], 3
    )
    row["dispatcher_over_raw_all_gather"] = round(
        row["raw_all_gather"]["median_ms"] / row["dispatcher_all_gather_v"]["median_ms"], 3
    )
    if rank == 0:
        print(
            f"{name:20s} {row['buffer_mib']:8.1f} MiB  "
            + "  ".join(f"{c} {row[c]['out_GBps']:7.1f} GB/s" for c in cases),
            flush=True,
        )
    return row


def main(argv=None):
    p = script_parser(__doc__, "collectives", 5, 20, "gloo on the CPU, small payloads (for tests)", device=False)
    p.add_argument(
        "--payloads", default="qwen2_57b_a14b,mixtral_8x22b,mixtral_8x22b_g8t8,sweep_8MiB,sweep_64MiB,sweep_256MiB"
    )
    a = p.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not a.smoke
    if a.smoke:
        a.payloads, a.warmup, a.iters = "tiny", 1, 3
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ep",))
    rows = [bench_payload(n, *PAYLOADS[n], mesh, device, a) for n in a.payloads.split(",")]
    if dist.get_rank() == 0:
        write_result(
            a.name,
            {
                "world_size": dist.get_world_size(),
                "dtype": "bfloat16",
                "warmup": a.warmup,
                "iters": a.iters,
                "rows": rows,
            },
            a.out_dir,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
