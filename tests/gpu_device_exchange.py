"""On 2 GPUs (torchrun --nproc_per_node 2 tests/gpu_device_exchange.py): the device exchange
(NVSHMEM all_to_all_vdev) against NCCL's exact exchange, MoE layer at ep 2 in bf16, with random
routing and with every token routed to rank 0's experts: equal outputs, input gradients and
parameter gradients, over several calls in a row (the symmetric buffers taken in turn), eager
and compiled. Prints one line "ok" per case on rank 0; raises on a mismatch."""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))
from helpers import DIM, make_layer  # noqa: E402

from titan_fold.moe import MoEArgs  # noqa: E402
from titan_fold.moe.exchange import nvshmem_available  # noqa: E402
from titan_fold.parallel.experts import shard_moe  # noqa: E402


def check_op(rank):
    """The op alone: random splits, several calls in a row, bf16 rows and fp32 columns, against
    the stand-in over NCCL (all_to_all_single). -> failures."""
    from titan_fold.moe.exchange import _stand_in, ep_exchange

    group_name = dist.group.WORLD.group_name
    failures = []
    for trial in range(8):
        for width, dtype in ((2048, torch.bfloat16), (1, torch.float32)):
            g = torch.Generator(device="cuda").manual_seed(10 * trial + rank)
            cap = 5000
            send = torch.randint(0, 2500, (2,), generator=g, device="cuda")
            m = int(send.sum())
            src = torch.randn(3000, width, generator=g, device="cuda").to(dtype)
            index = torch.randint(0, 3000, (m,), generator=g, device="cuda")
            recv = torch.empty_like(send)  # rows from each source
            dist.all_to_all_single(recv, send)
            got = ep_exchange(src, index, send, recv, torch.arange(cap + 1, device="cuda"), cap, group_name)
            want = _stand_in(src[index], send, recv, cap, group_name)
            V = int(want.abs().sum(1).ne(0).sum())  # rows received (random rows are nonzero)
            rows = torch.cat([torch.arange(V, device="cuda"), torch.tensor([cap], device="cuda")])
            if not torch.equal(got[rows], want[rows]):
                bad = (got[rows] != want[rows]).any(1).nonzero().flatten()
                failures.append(
                    f"rank {rank} trial {trial} width {width}: {bad.numel()} of {V} rows differ, "
                    f"first {bad[:5].tolist()}, send {send.tolist()}"
                )
    return failures


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("ep",))
    assert nvshmem_available(), "NVSHMEM is not available: the device exchange would take its stand-in"
    failures = check_op(rank)
    for f in failures:
        print(f, flush=True)
    if rank == 0:
        print(f"op: {'ok' if not failures else 'MISMATCH'}", flush=True)
    for skew, compiled in ((0.0, False), (3.0, False), (0.0, True)):
        args = MoEArgs(num_experts=8, top_k=2, moe_ffn_dim=64, shared_ffn_dim=64, load_balance="none")
        layer = make_layer(args, torch.bfloat16, seed=3, skew=skew).cuda()
        runs = {}
        for mode in ("exact", "device"):
            moe = copy.deepcopy(layer)
            moe.args.exchange = mode
            shard_moe(moe, mesh["ep"])
            call = torch.compile(moe) if compiled and mode == "device" else moe
            outs = []
            for i in range(3):  # calls in a row: each buffer of the ring reused
                g = torch.Generator(device="cuda").manual_seed(100 * rank + i)
                x = torch.randn(4, 256, DIM, generator=g, device="cuda").bfloat16()
                x = (x.abs() + 0.5 if skew else x).requires_grad_()
                y = call(x)
                (y.float() * torch.linspace(-1, 1, DIM, device="cuda")).sum().backward()
                outs += [y.detach(), x.grad]
            outs += [p.grad for p in moe.parameters()]
            runs[mode] = outs
        for i, (a, b) in enumerate(zip(runs["device"], runs["exact"], strict=True)):
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
            if err > 2e-2:
                failures.append(
                    f"rank {rank} skew {skew} compiled {compiled}: tensor {i} {tuple(a.shape)}: "
                    f"max error {err:.3g} of its largest value"
                )
        print(f"rank {rank} layer skew {skew} compiled {compiled}: {len(failures)} failures so far", flush=True)
    for f in failures:
        print(f, flush=True)
    dist.destroy_process_group()
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
