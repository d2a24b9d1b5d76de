"""The two folded device meshes of MoE Parallel Folding, and the checks that come before them.

Attention layers run on ("pp", "dp_replicate", "dp_shard", "cp", "tp"), MoE layers on
("pp", "edp", "ep", "etp"); both meshes cover the same ranks, row-major with the last name
fastest, and only pp is common to both. That ordering is Megatron-Core's `RankGenerator` with
order "tp-cp-ep-dp-pp" (first name fastest): the attention generator has ep=1, the expert
generator cp=1. See docs/layouts.md for worked examples.

`Layout` subclasses torchtitan's `ParallelDims` so torchtitan's set_determinism,
optimizer, metrics and checkpoint code accept it; `get_mesh` / `get_optional_mesh` answer
torchtitan's names ("batch", "loss", "fsdp", "efsdp", ...) and ours ("dp", "dp_cp", ...).
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_fold.common.errors import UserError
from titan_fold.compat.distributed import flatten_mesh, unflatten_mesh
from titan_fold.compat.titan import ParallelDimsHooks

__all__ = ["Layout", "LayoutError", "ATTENTION_DIMS", "EXPERT_DIMS", "FLATTENED", "divisors", "fits", "model_sizes"]

ATTENTION_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "etp")
# flattened views: name -> (mesh, the dims it spans, in mesh order)
FLATTENED = {
    "dp": ("attention", ("dp_replicate", "dp_shard")),  # data loading
    "dp_shard_cp": ("attention", ("dp_shard", "cp")),  # FSDP of dense parameters
    "dp_cp": ("attention", ("dp_replicate", "dp_shard", "cp")),  # loss, gradient reduction
    "cp_tp": ("attention", ("cp", "tp")),  # the ranks holding parts of the same sequences: MoE aux statistics
    "stage": ("attention", ("dp_replicate", "dp_shard", "cp", "tp")),  # every rank of one pipeline stage
    "ep_etp": ("expert", ("ep", "etp")),  # the whole expert-model-parallel group
}
# torchtitan's names for the same groups
ALIASES = {"batch": "dp", "loss": "dp_cp", "fsdp": "dp_shard_cp", "efsdp": "edp"}


class LayoutError(UserError, ValueError):
    """Degrees that cannot form both meshes (raised before any process group exists)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(value: int, candidates: list[int], k: int = 3) -> list[int]:
    # nearest on a log scale: degrees are mostly powers of two
    ranked = sorted(candidates, key=lambda c: (abs(math.log2(c) - math.log2(max(value, 1))), c))
    return sorted(ranked[:k])


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


@dataclass(init=False)
class Layout(ParallelDimsHooks):
    """Degrees of both meshes; `edp` (and `dp_shard`) -1 means derived from world_size."""

    edp: int = -1

    def __init__(
        self,
        world_size: int,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        etp: int = 1,
        edp: int = -1,
        model: dict | None = None,
        hints: bool = True,
    ):
        """model: the sizes `validate` will be given (num_experts=, n_heads=, ...), so that the
        neighbours a refusal proposes pass those checks too; hints False: refusals propose none
        (how the neighbours are tried, and a search that only counts the layouts that fit)."""
        self.world_size = world_size
        # the degrees as given (dp_shard and edp are derived in place): what a neighbour changes one of
        self._given = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp, edp=edp)
        self._model, self._hints = model or {}, hints
        self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp = pp, dp_replicate, dp_shard, cp, tp
        self.ep, self.etp, self.edp = ep, etp, edp
        self._meshes: dict[str, DeviceMesh] = {}
        self._world_mesh = None
        self._attention: DeviceMesh | None = None
        self._expert: DeviceMesh | None = None
        self._multi: dict[tuple[str, ...], DeviceMesh] = {}
        self.__post_init__()  # ParallelDims.__post_init__ -> validate_degrees()

    # ---- validation (pure arithmetic, no process group) ----

    def validate_degrees(self) -> None:
        w = self.world_size
        if not isinstance(w, int) or w < 1:
            raise LayoutError(f"world_size must be an integer >= 1, got {w!r}")
        for name in ("pp", "dp_replicate", "cp", "tp", "ep", "etp"):
            d = getattr(self, name)
            if not isinstance(d, int) or d < 1:
                raise LayoutError(f"{name} must be an integer >= 1, got {d!r}")
        for name in ("dp_shard", "edp"):
            d = getattr(self, name)
            if not isinstance(d, int) or not (d == -1 or d >= 1):
                raise LayoutError(f"{name} must be -1 (derived) or an integer >= 1, got {d!r}")

        pp, dpr, cp, tp, ep, etp = self.pp, self.dp_replicate, self.cp, self.tp, self.ep, self.etp
        if w % pp:
            raise LayoutError(f"pp({pp}) must divide world_size({w}); valid pp: {_fmt(self._neighbours('pp'))}")
        per_stage = w // pp

        # attention: pp * dp_replicate * dp_shard * cp * tp == world_size
        fixed = dpr * cp * tp
        if self.dp_shard == -1:
            if per_stage % fixed:
                raise LayoutError(
                    f"attention mesh: dp_replicate({dpr}) * cp({cp}) * tp({tp}) = {fixed} must divide "
                    f"world_size / pp = {w} / {pp} = {per_stage} so that dp_shard can be derived; "
                    + self._attention_neighbours(per_stage)
                )
            self.dp_shard = per_stage // fixed
        if pp * dpr * self.dp_shard * cp * tp != w:
            raise LayoutError(
                f"attention mesh: pp({pp}) * dp_replicate({dpr}) * dp_shard({self.dp_shard}) * cp({cp}) "
                f"* tp({tp}) = {pp * dpr * self.dp_shard * cp * tp} != world_size({w}); "
                + self._attention_neighbours(per_stage)
            )

        # experts: pp * edp * ep * etp == world_size
        if self.edp == -1:
            if per_stage % (ep * etp):
                raise LayoutError(
                    f"expert mesh: ep({ep}) * etp({etp}) = {ep * etp} must divide world_size / pp = "
                    f"{w} / {pp} = {per_stage} so that edp can be derived; " + self._expert_neighbours()
                )
            self.edp = per_stage // (ep * etp)
        if pp * self.edp * ep * etp != w:
            hint = (
                f"edp=-1 derives it ({per_stage // (ep * etp)})"
                if per_stage % (ep * etp) == 0
                else self._expert_neighbours()
            )
            raise LayoutError(
                f"expert mesh: pp({pp}) * edp({self.edp}) * ep({ep}) * etp({etp}) = "
                f"{pp * self.edp * ep * etp} != world_size({w}); {hint}"
            )

    def _neighbours(self, name: str, sizes: dict | None = None) -> list[int]:
        """The values of degree `name` nearest the given one that pass the check refusing it,
        the other degrees as given: its mesh (the other mesh's degrees left out: a refusal
        of that one, if any, comes next with its own neighbours) with the model's sizes
        (those at build), or, `sizes` given, both meshes and these sizes."""
        if not self._hints:
            return []
        if sizes is not None:  # a model check: both meshes have formed
            others = {}
        elif name in ("ep", "etp", "edp"):
            others = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1)
        else:
            others = dict(ep=1, etp=1, edp=-1)
        sizes = self._model if sizes is None else sizes
        valid = [d for d in divisors(self.world_size) if fits(self.world_size, self._given | others | {name: d}, sizes)]
        return _nearest(self._given[name], valid)

    def _attention_neighbours(self, per_stage: int) -> str:
        dpr, cp, tp = self.dp_replicate, self.cp, self.tp
        hints = []
        if per_stage % (dpr * cp * tp) == 0:
            hints.append(f"dp_shard={per_stage // (dpr * cp * tp)} (or -1 to derive it)")
        for name in ("tp", "cp", "dp_replicate"):
            if valid := self._neighbours(name):
                hints.append(f"{name} in {{{_fmt(valid)}}}")
        return "valid neighbours: " + ("; ".join(hints) or "none with one degree changed")

    def _expert_neighbours(self) -> str:
        hints = []
        for name, other in (("ep", "etp"), ("etp", "ep")):
            if valid := self._neighbours(name):
                hints.append(f"{name} in {{{_fmt(valid)}}} (with {other}={getattr(self, other)})")
        return "valid neighbours: " + ("; ".join(hints) or "none with one degree changed")

    def validate(
        self,
        num_experts: int | None = None,
        moe_ffn_dim: int | None = None,
        n_heads: int | None = None,
        n_kv_heads: int | None = None,
        seq_len: int | None = None,
        sequence_parallel: bool = True,
    ) -> "Layout":
        """Check the degrees against the model's sizes; None skips a check. Returns self."""
        ep, etp, tp, cp = self.ep, self.etp, self.tp, self.cp
        sizes = dict(
            num_experts=num_experts,
            moe_ffn_dim=moe_ffn_dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            seq_len=seq_len,
            sequence_parallel=sequence_parallel,
        )
        if num_experts is not None and num_experts % ep:
            raise LayoutError(
                f"num_experts({num_experts}) % ep({ep}) = {num_experts % ep} != 0: every EP rank holds "
                f"num_experts / ep experts; valid ep (dividing {num_experts} and world_size / pp / etp): "
                f"{_fmt(self._neighbours('ep', sizes))}"
            )
        if moe_ffn_dim is not None and moe_ffn_dim % etp:
            raise LayoutError(
                f"moe_ffn_dim({moe_ffn_dim}) % etp({etp}) = {moe_ffn_dim % etp} != 0: ETP shards the "
                f"expert ffn width; valid etp: {_fmt(self._neighbours('etp', sizes))}"
            )
        for what, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if heads is not None and heads % tp:
                raise LayoutError(
                    f"{what}({heads}) % tp({tp}) = {heads % tp} != 0: TP shards attention heads; "
                    f"valid tp: {_fmt(self._neighbours('tp', sizes))}"
                )
        if seq_len is not None:
            need = (2 * cp if cp > 1 else 1) * (tp if sequence_parallel and tp > 1 else 1)
            if seq_len % need:
                parts = []
                if cp > 1:
                    parts.append(f"2 * cp({cp}) (load-balanced causal split)")
                if sequence_parallel and tp > 1:
                    parts.append(f"tp({tp}) (sequence parallel)")
                valid_up = (seq_len // need + 1) * need
                raise LayoutError(
                    f"seq_len({seq_len}) % {' * '.join(parts)} = seq_len % {need} = {seq_len % need} != 0; "
                    f"nearest valid seq_len: {seq_len - seq_len % need or need}, {valid_up}"
                )
        return self

    def validate_model(self, model_args, seq_len: int | None = None) -> "Layout":
        """`validate` against a model's sizes (a TransformerArgs); None skips the sequence check."""
        return self.validate(**model_sizes(model_args, seq_len))

    # ---- meshes ----

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def degrees(self, mesh: str) -> dict[str, int]:
        names = ATTENTION_DIMS if mesh == "attention" else EXPERT_DIMS
        return {name: getattr(self, name) for name in names}

    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """Build both meshes and the flattened views; returns the attention mesh.

        Degree-1 dims (and flattened views of size 1) get the "fake" backend: no real process group.
        """
        if device_type is None:
            from titan_fold.common.device import device_type as this_device

            device_type = this_device()

        def build(names):
            sizes = tuple(getattr(self, n) for n in names)
            fake = {n: "fake" for n, s in zip(names, sizes, strict=True) if s == 1}
            return init_device_mesh(device_type, sizes, mesh_dim_names=names, backend_override=fake or None)

        self._attention = build(ATTENTION_DIMS)
        self._expert = build(EXPERT_DIMS)
        meshes = {"attention": self._attention, "expert": self._expert}
        self._meshes = {n: self._attention[n] for n in ATTENTION_DIMS}
        self._meshes.update({n: self._expert[n] for n in EXPERT_DIMS if n != "pp"})
        for name, (mesh, dims) in FLATTENED.items():
            size = math.prod(getattr(self, d) for d in dims)
            self._meshes[name] = flatten_mesh(meshes[mesh][dims], name, "fake" if size == 1 else None)
        self._multi = {}
        self._world_mesh = self._attention
        self._validate_meshes()
        return self._attention

    @property
    def attention(self) -> DeviceMesh:
        if self._attention is None:
            self.build_mesh()
        return self._attention

    @property
    def expert(self) -> DeviceMesh:
        if self._expert is None:
            self.build_mesh()
        return self._expert

    @property
    def world_mesh(self) -> DeviceMesh:
        return self.attention

    def size(self, name: str) -> int:
        """Degree of one (possibly flattened or torchtitan-named) dim, no mesh needed."""
        name = ALIASES.get(name, name)
        if name in FLATTENED:
            return math.prod(getattr(self, d) for d in FLATTENED[name][1])
        if name in ATTENTION_DIMS or name in EXPERT_DIMS:
            return getattr(self, name)
        raise ValueError(f"Invalid mesh dim: '{name}'. Valid: {self.mesh_names()}")

    @staticmethod
    def mesh_names() -> list[str]:
        return list(dict.fromkeys(ATTENTION_DIMS + EXPERT_DIMS + tuple(FLATTENED) + tuple(ALIASES)))

    def _exists(self, name: str) -> bool:
        # torchtitan keeps efsdp whenever EP is on: FSDP wraps the experts for mixed precision
        if name == "efsdp":
            return self.ep > 1 or self.edp > 1
        return self.size(name) > 1

    def get_optional_mesh(self, dims: str | list[str]) -> DeviceMesh | None:
        """torchtitan's semantics: None when any requested dim has size 1.

        Several names come from the one mesh that holds them all (attention or expert): sliced
        when they are mesh dims, else their span is unflattened, e.g. torchtitan's HSDP
        ["dp_replicate", "fsdp"] is dp_cp unflattened to (dp_replicate, dp_shard_cp).
        """
        names = [dims] if isinstance(dims, str) else list(dims)
        for name in names:
            if ALIASES.get(name, name) not in self.mesh_names():
                raise ValueError(f"Invalid mesh dim: '{name}'. Valid dimensions are: {self.mesh_names()}")
        if not all(self._exists(n) for n in names):
            return None
        canonical = [ALIASES.get(n, n) for n in names]
        if not self._meshes:
            self.build_mesh()
        if len(canonical) == 1:
            return self._meshes[canonical[0]]
        key = tuple(canonical)
        if key not in self._multi:
            self._multi[key] = self._multi_dim_mesh(key)
        return self._multi[key]

    def _multi_dim_mesh(self, names: tuple[str, ...]) -> DeviceMesh:
        # torchtitan's HSDP of experts: edp = dp_replicate x (edp / dp_replicate) when the
        # expert-model-parallel block (ep x etp) folds inside one dp_replicate slice
        if names == ("dp_replicate", "edp"):
            inner = self.dp_shard * self.cp * self.tp
            if inner % (self.ep * self.etp):
                raise LayoutError(
                    f"expert HSDP needs ep({self.ep}) * etp({self.etp}) to divide dp_shard({self.dp_shard}) "
                    f"* cp({self.cp}) * tp({self.tp}) = {inner}: here the EP group spans dp_replicate; "
                    f"shard experts over 'edp' alone"
                )
            sizes = (self.dp_replicate, self.edp // self.dp_replicate)
            return unflatten_mesh(self._meshes["edp"], 0, sizes, ("dp_replicate", "efsdp"))
        for mesh in (self._attention, self._expert):
            assert mesh is not None, "build_mesh() first"
            dims = mesh.mesh_dim_names
            expanded = [d for n in names for d in (FLATTENED[n][1] if n in FLATTENED else (n,))]
            if not set(expanded) <= set(dims):
                continue
            if all(n in dims for n in names):
                return mesh[names]
            # a flattened name among others: unflatten the span instead of slicing a flattened
            # dim out of the root mesh (deprecated in torch 2.11)
            if [dims.index(d) for d in expanded] != list(
                range(dims.index(expanded[0]), dims.index(expanded[0]) + len(expanded))
            ):
                break
            known = [f for f, (_, fdims) in FLATTENED.items() if list(fdims) == expanded]
            span = self._meshes[known[0]] if known else flatten_mesh(mesh[tuple(expanded)], "_".join(expanded))
            return unflatten_mesh(span, 0, tuple(self.size(n) for n in names), names)
        raise ValueError(f"Mesh dims {names} do not form one contiguous span of the attention or expert mesh")

    def __repr__(self) -> str:
        att = ", ".join(f"{k}={v}" for k, v in self.degrees("attention").items())
        exp = ", ".join(f"{k}={v}" for k, v in self.degrees("expert").items())
        return f"Layout(world_size={self.world_size}; attention: {att}; expert: {exp})"

    def get_all_one_dimensional_meshes(self) -> dict[str, DeviceMesh]:
        if not self._meshes:
            self.build_mesh()
        return {k: v for k, v in self._meshes.items() if v.size() > 1}

    def _validate_meshes(self):
        for name, mesh in self._meshes.items():
            if mesh.size() != self.size(name):
                raise AssertionError(f"mesh '{name}' has size {mesh.size()}, expected {self.size(name)}")

    # ---- whole-world group lists (for the layout tool and tests) ----

    def root_ranks(self, mesh: str) -> tuple[torch.Tensor, tuple[str, ...]]:
        """([*degrees] global ranks, dim names) of the "attention" or "expert" root mesh: the
        whole world, as the root mesh tensor holds it."""
        root = self.attention if mesh == "attention" else self.expert
        return root.mesh, tuple(root.mesh_dim_names)

    def groups(self, name: str, mesh: str | None = None) -> list[list[int]]:
        """Every group of one (possibly flattened) dim over the whole world, from the mesh tensor.

        Each group lists its global ranks in mesh order; groups are sorted by their first rank.
        `mesh` picks the mesh for "pp" (both hold it; default attention). Read off the root mesh
        tensor, so it needs no process group per group.
        """
        return self.group_rows(name, mesh).tolist()

    def group_rows(self, name: str, mesh: str | None = None) -> torch.Tensor:
        """groups() as a tensor [groups, group size]."""
        name = ALIASES.get(name, name)
        if name in FLATTENED:
            mesh, dims = FLATTENED[name][0], FLATTENED[name][1]
        elif name in EXPERT_DIMS and (name != "pp" or mesh == "expert"):
            mesh, dims = "expert", (name,)
        elif name in ATTENTION_DIMS:
            mesh, dims = "attention", (name,)
        else:
            raise ValueError(f"Invalid mesh dim: '{name}'. Valid: {self.mesh_names()}")
        full, names = self.root_ranks(mesh)
        keep = [names.index(d) for d in dims]
        rest = [i for i in range(full.ndim) if i not in keep]
        rows = full.permute(*rest, *keep).reshape(-1, math.prod(full.shape[i] for i in keep))
        return rows[rows[:, 0].argsort()]


def model_sizes(model_args, seq_len: int | None = None) -> dict:
    """A model's sizes (a TransformerArgs) as `validate`'s keywords; None skips the sequence check."""
    return dict(
        num_experts=model_args.moe.num_experts,
        moe_ffn_dim=model_args.moe.moe_ffn_dim,
        n_heads=model_args.n_heads,
        n_kv_heads=model_args.n_kv_heads,
        seq_len=seq_len,
    )


def fits(world_size: int, degrees: dict[str, Any], sizes: dict | None = None) -> bool:
    """Whether `degrees` (Layout's keywords) form both meshes of world_size ranks and pass
    `validate(**sizes)`: the test a proposed neighbour passes."""
    try:
        Layout(world_size, **degrees, hints=False).validate(**(sizes or {}))
    except LayoutError:
        return False
    return True
