"""One real 8-rank gloo launch: both meshes of several layouts, collectives on every named group."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import forget_earlier_meshes
from test_layout import reference

import titan_fold  # noqa: F401  (imported once in the parent; forked ranks inherit it)
from titan_fold.parallel.mesh import Layout

WORLD = 8
# (world, pp, dp_replicate, dp_shard, cp, tp, ep, etp)
LAYOUTS = [
    (8, 2, 1, 2, 1, 2, 4, 1),  # pp, EP(4) > dp(2)
    (8, 1, 2, 1, 2, 2, 2, 4),  # ETP(4) > TP(2), dp_replicate
    (8, 1, 2, 2, 2, 1, 8, 1),  # EP spans dp_replicate, dp x cp
    (8, 1, 1, 1, 8, 1, 8, 1),  # CP8 x EP8 folded
    (8, 1, 1, 2, 1, 4, 2, 2),  # ETP(2) < TP(4)
]


def _check(mesh, expected: list[int], what: str):
    rank = dist.get_rank()
    assert mesh.mesh.tolist() == expected, (what, rank, mesh.mesh.tolist(), expected)
    group = mesh.get_group()
    x = torch.tensor([float(rank)], dtype=torch.float64)
    dist.all_reduce(x, group=group)
    assert x.item() == sum(expected), (what, rank, x.item(), expected)
    if len(expected) > 1:  # real group: members in mesh order
        out = torch.zeros(len(expected), dtype=torch.float64)
        dist.all_gather_into_tensor(out, torch.tensor([float(rank)], dtype=torch.float64), group=group)
        assert out.tolist() == [float(r) for r in expected], (what, rank, out.tolist(), expected)


def _worker(rank: int, store_path: str):
    torch.set_num_threads(1)  # 8 ranks share 2 cores: no intra-op threads spinning against each other
    forget_earlier_meshes()
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    checked = 0
    for cfg in LAYOUTS:
        world, pp, dpr, dps, cp, tp, ep, etp = cfg
        layout = Layout(world, pp=pp, dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, ep=ep, etp=etp)
        layout.build_mesh("cpu")  # a CPU gloo world, also on a GPU machine
        ref = reference(*cfg)
        mine = {name: next(g for g in groups if rank in g) for name, groups in ref.items()}
        for name, mesh in layout._meshes.items():  # every named 1-D group, degree 1 (fake) included
            _check(mesh, mine[name], f"{cfg} {name}")
            checked += 1
        _check(layout.expert["pp"], mine["expert.pp"], f"{cfg} expert.pp")
        # multi-dim meshes torchtitan asks for: each dim's group is right
        multi = [(["dp_replicate", "fsdp"], ["dp_replicate", "dp_shard_cp"]), (["ep", "etp"], ["ep", "etp"])]
        if (dps * cp * tp) % (ep * etp) == 0:
            multi.append((["dp_replicate", "efsdp"], ["dp_replicate", None]))
        for names, dims in multi:
            mesh = layout.get_optional_mesh(names)
            if mesh is None:
                continue
            for i, dim in enumerate(dims):
                sub = mesh[mesh.mesh_dim_names[i]]
                if dim is None:  # expert HSDP shard dim: edp members sharing this dp_replicate index
                    rep = next(g for g in ref["dp_replicate"] if rank in g)
                    expected = [r for r in mine["edp"] if next(g for g in ref["dp_replicate"] if r in g) == rep]
                else:
                    expected = mine[dim]
                _check(sub, expected, f"{cfg} {names}[{i}]")
                checked += 1
    assert checked >= 60, checked
    dist.barrier()
    dist.destroy_process_group()


def test_layout_collectives_on_gloo(tmp_path):
    # fork: children reuse the parent's imported torch/torchtitan (spawn re-imports them 8 times)
    mp.start_processes(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True, start_method="fork")
