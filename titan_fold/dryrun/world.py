"""The fake world a dry run simulates its ranks in, and DTensor's sharding decisions shared by them."""

import contextlib
import dataclasses

import torch.distributed as dist

from titan_fold.compat.dispatch import (
    clear_dtensor_caches,
    dtensor_spec_class,
    fake_store,
    op_schema_classes,
    sharding_propagator,
    tree_leaves,
)
from titan_fold.parallel.mesh import ATTENTION_DIMS, EXPERT_DIMS, Layout


def init_fake_world(world_size: int, rank: int) -> None:
    """A fake process group of world_size ranks in which this process is `rank`."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_dtensor_decisions()
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)


def _forget_dtensor_decisions() -> None:
    # DTensor caches sharding and redistribution decisions keyed by mesh *value*; the next
    # simulated rank's meshes equal the last one's by value but hold other process groups
    clear_dtensor_caches()


class SharedShardingDecisions:
    """DTensor's sharding propagation of one op schema, computed once for all simulated ranks.

    Every rank's meshes are new objects (its own process groups), equal by value to the other
    ranks' (DeviceMesh compares shape, ranks and dim names; not the coordinate): DTensor's own
    caches would hand a rank the meshes of the rank that filled them, and are cleared per rank.
    Here a decision made for an earlier rank is handed out with that rank's meshes replaced by
    this schema's. Propagation reads the mesh's shape only (torch's tensor/_ops and
    _sharding_prop never ask a mesh for its coordinate, rank or groups), so the decision is
    the one this rank would compute; redistribution plans (coordinate-dependent local shapes)
    are still cleared per rank."""

    def __init__(self, compute):
        self.compute = compute
        self.known: dict = {}  # OpSchema, by value -> (the schema it was computed for, decision)

    def __call__(self, op_schema):
        hit = self.known.get(op_schema)
        if hit is None:
            out = self.compute(op_schema)
            self.known[op_schema] = (op_schema, out)
            return out
        then, out = hit
        meshes = {id(a): b for a, b in zip(_meshes(then), _meshes(op_schema), strict=True) if a is not b}
        return _rebind(out, meshes) if meshes else out

    @staticmethod
    @contextlib.contextmanager
    def installed():
        prop = sharding_propagator()
        prop.propagate_op_sharding_non_cached = SharedShardingDecisions(prop.propagate_op_sharding_non_cached)
        try:
            yield
        finally:
            del prop.propagate_op_sharding_non_cached  # the class's method again


def _rebind(x, meshes: dict):
    """x with every DTensorSpec's mesh replaced through `meshes` (id -> mesh); the rest (the
    placements included: a _MaskPartial carries the embedding's mask from its op to the
    reduction, as in one process) shared."""
    DTensorSpec = dtensor_spec_class()
    OpSchema, OutputSharding = op_schema_classes()

    if isinstance(x, DTensorSpec):
        return dataclasses.replace(x, mesh=meshes.get(id(x.mesh), x.mesh))
    if isinstance(x, OutputSharding):
        return dataclasses.replace(
            x, output_spec=_rebind(x.output_spec, meshes), redistribute_schema=_rebind(x.redistribute_schema, meshes)
        )
    if isinstance(x, OpSchema):
        return dataclasses.replace(
            x, args_schema=_rebind(x.args_schema, meshes), kwargs_schema=_rebind(x.kwargs_schema, meshes)
        )
    if isinstance(x, (tuple, list)):
        return type(x)(_rebind(a, meshes) for a in x)
    if isinstance(x, dict):
        return {k: _rebind(v, meshes) for k, v in x.items()}
    return x


def _meshes(op_schema) -> list:
    DTensorSpec = dtensor_spec_class()
    return [a.mesh for a in tree_leaves((op_schema.args_schema, op_schema.kwargs_schema)) if isinstance(a, DTensorSpec)]


def positions(layout: Layout) -> list[int]:
    """One rank per distinct position: the first and the last rank of every pipeline stage
    (the last holds the last dp / ep / etp coordinate, where uneven FSDP shards are smallest)."""
    per_stage = layout.world_size // layout.pp
    return sorted({r for p in range(layout.pp) for r in (p * per_stage, (p + 1) * per_stage - 1)})


def coordinates(layout: Layout) -> dict:
    att = dict(zip(ATTENTION_DIMS, layout.attention.get_coordinate(), strict=True))
    exp = dict(zip(EXPERT_DIMS, layout.expert.get_coordinate(), strict=True))
    return {"attention": att, "expert": exp}
