"""One real 8-rank gloo launch: both meshes of several layouts, collectives on every named group."""

from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from helpers import Degrees, reference
from launcher import run_ranks, start_rank

from titan_fold.parallel.mesh import Layout

pytestmark = pytest.mark.slow  # minutes or forked ranks: the full suite only

WORLD = 8
LAYOUTS = [
    Degrees(world=8, pp=2, dpr=1, dps=2, cp=1, tp=2, ep=4, etp=1),  # pp, EP(4) > dp(2)
    Degrees(world=8, pp=1, dpr=2, dps=1, cp=2, tp=2, ep=2, etp=4),  # ETP(4) > TP(2), dp_replicate
    Degrees(world=8, pp=1, dpr=2, dps=2, cp=2, tp=1, ep=8, etp=1),  # EP spans dp_replicate, dp x cp
    Degrees(world=8, pp=1, dpr=1, dps=1, cp=8, tp=1, ep=8, etp=1),  # CP8 x EP8 folded
    Degrees(world=8, pp=1, dpr=1, dps=2, cp=1, tp=4, ep=2, etp=2),  # ETP(2) < TP(4)
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


def _worker(rank: int, port: int, out_dir: str):
    start_rank(rank, port, WORLD)
    checked = 0
    for c in LAYOUTS:
        layout = Layout(c.world, pp=c.pp, dp_replicate=c.dpr, dp_shard=c.dps, cp=c.cp, tp=c.tp, ep=c.ep, etp=c.etp)
        layout.build_mesh("cpu")  # a CPU gloo world, also on a GPU machine
        ref = reference(**asdict(c))
        mine = {name: next(g for g in groups if rank in g) for name, groups in ref.items()}
        for name, mesh in layout._meshes.items():  # every named 1-D group, degree 1 (fake) included
            _check(mesh, mine[name], f"{c} {name}")
            checked += 1
        _check(layout.expert["pp"], mine["expert.pp"], f"{c} expert.pp")
        # multi-dim meshes torchtitan asks for: each dim's group is right
        multi = [(["dp_replicate", "fsdp"], ["dp_replicate", "dp_shard_cp"]), (["ep", "etp"], ["ep", "etp"])]
        if (c.dps * c.cp * c.tp) % (c.ep * c.etp) == 0:
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
                _check(sub, expected, f"{c} {names}[{i}]")
                checked += 1
    assert checked >= 60, checked
    dist.barrier()
    dist.destroy_process_group()


def test_layout_collectives_on_gloo(tmp_path):
    run_ranks(_worker, WORLD, tmp_path)
