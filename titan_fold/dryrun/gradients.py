"""The dry run's gradient check (`--comm.check_gradients`): every parameter's gradient
reductions and its share of the gradient norm, as the recorded training step performs them,
against what the placement plan implies (titan_fold.parallel.reductions).

It rides on the step the collective check records (record.step_collectives: one training
step of the shrunk model per simulated rank, at the real world size). On that step:

- every parameter's incoming gradient, at each backward that reaches it, is replaced by a
  constant c (its own, from its name) and tagged with the parameter's name (a tensor hook
  on the leaf autograd sees: FSDP2's unsharded parameter, or the parameter itself);
- a dispatch mode follows the tags through every op (the local ops inside DTensor's own
  dispatch included: it lets DTensor ops descend), and each collective whose input carries
  a tag is recorded against those parameters with its group's ranks; a fake process group
  delivers nothing, so the mode gives each collective the result it has when every member
  holds what this rank holds (a sum over n ranks: n times the input; a reduce-scatter: n
  times this rank's chunk);
- when the trainer clips, the gradients are complete: each parameter's local gradient must
  read c x (backward passes) x (size of the plan's group), its recorded reductions must
  reach exactly the plan's group (ranks, not only a count), and no other collective (a
  gather, an all-to-all) may have touched it;
- the clip runs as the trainer calls it, its reductions recorded the same way: each
  parameter's norm must have been reduced over the ranks that hold its distinct pieces and
  pp, and the total must equal the sum over parameters of (local squared norm x number of
  distinct pieces x pp), i.e. each piece counted once; a replica counted twice, or a
  replicated parameter summed over its replicas, changes it. If it does not, the clip is
  run again per parameter (the others' gradients zero) to name the ones counted wrongly.

What this does not prove: the values of any kernel, the activations' collectives (the
sequence-parallel gathers, the dispatcher's all-to-all and reduce-scatter: the collective
check matches them across ranks, the one-rank equivalence tests check their numbers at small
layouts), and ranks not simulated.
"""

import contextlib
import math
import zlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_fold.common.tensors import model_fqn
from titan_fold.compat.dispatch import (
    FakeTensor,
    TorchDispatchMode,
    is_boxed_group,
    local_tensor,
    op_name,
    op_schema_arguments,
    storage_key,
    tree_leaves,
)
from titan_fold.compat.distributed import AsyncCollectiveTensor, resolve_process_group
from titan_fold.compat.ops import own_parameters
from titan_fold.dryrun.copies import CopyGradients
from titan_fold.dryrun.record import record_collectives, shrunk_config
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.placement import placement_plan
from titan_fold.parallel.reductions import Expected, Groups, expected
from titan_fold.planning.accounting import param_kind
from titan_fold.trainer.preflight import layout_from_config

# collectives by what they do to a gradient: sum over the group, or move pieces around
_REDUCING = {
    "all_reduce",
    "all_reduce_",
    "all_reduce_coalesced",
    "all_reduce_coalesced_",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "allreduce_",
    "allreduce_coalesced_",
    "_reduce_scatter_base_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
}
_SKIP = {"wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd"}
_NAMESPACES = ("_c10d_functional.", "c10d.", "_dtensor.")
REL_TOL = 1e-4


def gradient_kind(fqn: str) -> str:
    """The kind of a parameter in the check's table."""
    if fqn.startswith("mtp") or ".mtp" in fqn:
        return "MTP"
    kind = param_kind(fqn)
    return {"embedding": "embeddings", "output head": "head"}.get(kind, kind)


def constant_of(fqn: str, numel: int, group: int) -> float:
    """The value a parameter's incoming gradient is replaced by: its own (from its name), and
    such that its summed gradient's squared norm, numel x (group x c)^2, is between 1 and 4
    per backward pass for every parameter: a parameter counted twice in the total norm moves
    it by a share no smaller than the others'."""
    return (1.0 + (zlib.crc32(fqn.encode()) % 64) / 64) / (math.sqrt(numel) * group)


def _local(t):
    if isinstance(t, DTensor):
        return local_tensor(t)
    if isinstance(t, AsyncCollectiveTensor):
        return t.elem
    return t


def _key(t) -> int | None:
    t = _local(t)
    if not isinstance(t, torch.Tensor) or isinstance(t, (FakeTensor, DTensor)) or t.is_meta:
        return None
    try:
        return storage_key(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class GradientTracer(TorchDispatchMode):
    """Follows parameter-name tags through the ops of a step and records the collectives
    that carry them (see the module docstring). phase: "grad" (backward), "norm" (the clip),
    None (before the first tag, after the clip: nothing followed)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.tags: dict[int, frozenset[str]] = {}
        self.storages: list = []  # tagged storages stay alive: their addresses are keys
        self.phase: str | None = "grad"
        self.recording = True
        # (phase, fqn) -> [(op, group ranks, reducing)]
        self.events: dict[tuple[str | None, str], list[tuple[str, tuple[int, ...], bool]]] = defaultdict(list)

    def tag(self, t: torch.Tensor, names) -> None:
        local = _local(t)
        key = _key(local)
        if key is None:
            return
        self.tags[key] = self.tags.get(key, frozenset()) | frozenset(names)
        self.storages.append(local.untyped_storage())

    def tags_of(self, tensors) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for t in tensors:
            key = _key(t)
            if key is not None and key in self.tags:
                out |= self.tags[key]
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.phase is None or not self.tags:
            return func(*args, **kwargs)
        leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(isinstance(a, FakeTensor) for a in leaves):  # DTensor's sharding propagation
            return func(*args, **kwargs)
        names = self.tags_of(leaves)
        if not names:
            return func(*args, **kwargs)
        if DTensor in types:
            return NotImplemented  # let DTensor run, its local ops and collectives seen here
        op = op_name(func)
        if op.startswith(_NAMESPACES) and op.split(".", 1)[1] not in _SKIP:
            return self._collective(op.split(".", 1)[1], func, args, kwargs, names)
        out = func(*args, **kwargs)
        for t in [*tree_leaves(out), *self._written(func, args, kwargs)]:
            if isinstance(t, torch.Tensor):
                self.tag(t, names)
        return out

    @staticmethod
    def _written(func, args, kwargs) -> list:
        out = []
        for i, a in enumerate(op_schema_arguments(func)):
            if a.alias_info is not None and a.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(a.name)
                out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        return out

    def _collective(self, op: str, func, args, kwargs, names):
        group, strs = None, []
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, str):
                strs.append(a)
            elif isinstance(a, dist.ProcessGroup):
                group = a
            elif is_boxed_group(a):
                group = dist.ProcessGroup.unbox(a)
        if group is None and strs:
            group = resolve_process_group(strs[-1])
        out = func(*args, **kwargs)
        if group is None:
            return out
        ranks = tuple(dist.get_process_group_ranks(group))
        n, me = len(ranks), ranks.index(self.rank) if self.rank in ranks else 0
        reducing = op in _REDUCING
        if self.recording and n > 1:
            for name in names:
                self.events[(self.phase, name)].append((op, ranks, reducing))
        # functional reductions name their op first; c10d's (FSDP2 on gloo: forced SUM) carry an object
        factor = n if (not strs or strs[0] == "sum") else 1
        with torch.no_grad():
            for dst, src in self._pairs(op, args, kwargs, out):
                if reducing and dst.numel() != src.numel():  # a reduce-scatter: this rank's chunk
                    src = src.reshape(n, -1)[me]
                elif not reducing and dst.numel() != src.numel():  # a gather: every member sent the same
                    src = src.reshape(1, -1).expand(n, -1)
                dst.copy_(src.reshape(dst.shape) * (factor if reducing else 1))
                self.tag(dst, names)
        return out

    @staticmethod
    def _pairs(op: str, args, kwargs, out) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(output, input) tensors of a collective, each pair one tensor's result."""
        if op in ("allreduce_", "allreduce_coalesced_"):
            return [(t, t.clone()) for t in args[0]]
        if op in ("_reduce_scatter_base_", "_allgather_base_"):
            return [(args[0], args[1])]
        if op == "reduce_scatter_tensor_coalesced_":
            return list(zip(args[0], args[1], strict=True))
        if op in ("all_reduce_", "all_reduce_coalesced_"):
            return [(t, t.clone()) for t in tree_leaves(args[0])]
        if op in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"):
            return [(out, args[0])]
        if op in ("all_reduce_coalesced", "reduce_scatter_tensor_coalesced", "all_gather_into_tensor_coalesced"):
            return list(zip(out, args[0], strict=True))
        return []  # all-to-all, broadcast, ...: recorded, values left as the fake group leaves them


@dataclass
class RankResult:
    rank: int
    params: dict[str, dict] = field(default_factory=dict)  # fqn -> its findings (see _judge)


class GradientWatch:
    """One simulated rank's step: hooks in, tracer on, clip wrapped; `result` after the clip."""

    def __init__(self, trainer, layout: Layout, rank: int, plan: dict, groups: Groups):
        self.trainer, self.layout, self.rank, self.plan, self.groups = trainer, layout, rank, plan, groups
        self.tracer = GradientTracer(rank)
        self.fires: dict[str, int] = defaultdict(int)
        self.constants: dict[str, float] = {}  # the value each gradient was given, in its dtype
        self.hooked: set[int] = set()
        self.handles: list = []
        self.result = RankResult(rank)
        self.names = {id(m): model_fqn(name) for part in trainer.model_parts for name, m in part.named_modules()}
        self.params = [(model_fqn(fqn), p) for part in trainer.model_parts for fqn, p in part.named_parameters()]
        self.copies = CopyGradients(self.tracer, layout, groups, rank, constant_of, plan)  # moe.hot_expert_replicas

    def __enter__(self):
        for part in self.trainer.model_parts:
            for module in part.modules():
                if own_parameters(module):
                    self.handles.append(module.register_forward_pre_hook(self._hook_leaves))
        self.copies.install(self.trainer.model_parts, self.names, [fqn for fqn, _ in self.params])
        self.clip = self.trainer.clip_grad_norm
        self.trainer.clip_grad_norm = self._clip
        self.tracer.__enter__()
        return self

    def __exit__(self, *exc):
        self.tracer.__exit__(*exc)
        self.trainer.clip_grad_norm = self.clip
        for h in self.handles:
            h.remove()
        return False

    def _hook_leaves(self, module, args) -> None:
        # at forward: FSDP2 has put its unsharded parameters (the autograd leaves) in place
        prefix = self.names[id(module)]
        for name, p in own_parameters(module).items():
            if p is None or not p.requires_grad or id(p) in self.hooked:
                continue
            self.hooked.add(id(p))
            fqn = f"{prefix}.{name}" if prefix else name
            self.handles.append(p.register_hook(self._replace(fqn)))

    def _replace(self, fqn: str):
        placed = self.plan[fqn]
        exp = expected(placed, self.layout)
        c = constant_of(fqn, math.prod(placed.shape), math.prod(self.layout.size(d) for d in exp.grad_dims))

        def hook(grad):
            self.fires[fqn] += 1
            local = torch.full_like(_local(grad), c)
            self.constants[fqn] = float(torch.tensor(c, dtype=local.dtype))
            self.tracer.tag(local, [fqn])
            if isinstance(grad, DTensor):
                return DTensor.from_local(
                    local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
                )
            return local

        return hook

    # ---- the clip: gradients complete before it, norms during it

    def _clip(self, *args, **kwargs):
        self.tracer.phase = None
        p = float(kwargs.get("norm_type", 2.0))
        found = {}
        for fqn, param in self.params:
            found[fqn] = self._gradient(fqn, param)
        snapshot = {fqn: _local(param.grad).detach().clone() for fqn, param in self.params if param.grad is not None}
        self.tracer.phase = "norm"
        total = self.clip(*args, **kwargs)
        self.tracer.phase = None
        local_p = (
            {
                fqn: float(torch.linalg.vector_norm(s.double(), p) ** p) if s.numel() else 0.0
                for fqn, s in snapshot.items()
            }
            if math.isfinite(p)
            else {}
        )
        pieces = {fqn: math.prod(self.layout.size(d) for d in found[fqn]["expected"].norm_dims) for fqn in found}
        counts = {}
        if math.isfinite(p):
            want = sum(local_p[f] * pieces[f] for f in local_p)
            got = float(total) ** p
            if not _close(got, want):
                counts = self._probe(args, kwargs, snapshot, p, local_p, pieces)
            else:
                counts = dict.fromkeys(local_p, 1.0)
        for fqn, _ in self.params:
            self.result.params[fqn] = self._judge(fqn, found[fqn], counts.get(fqn))
        self.result.params.update(self.copies.judge())
        return total

    def _probe(self, args, kwargs, snapshot, p, local_p, pieces) -> dict[str, float]:
        """Each parameter's count in the norm: the clip again with only its gradient."""
        self.tracer.phase, self.tracer.recording = "norm", False
        counts = {}
        try:
            for fqn in snapshot:
                for other, param in self.params:
                    if other in snapshot:
                        g = _local(param.grad)
                        g.copy_(snapshot[other]) if other == fqn else g.zero_()
                want = local_p[fqn] * pieces[fqn]
                got = float(self.clip(*args, **kwargs)) ** p
                counts[fqn] = got / want if want else (1.0 if got == 0 else math.inf)
        finally:
            self.tracer.phase, self.tracer.recording = None, True
            for fqn, param in self.params:
                if fqn in snapshot:
                    _local(param.grad).copy_(snapshot[fqn])
        return counts

    def _gradient(self, fqn: str, param) -> dict:
        exp: Expected = expected(self.plan[fqn], self.layout)
        events = self.tracer.events.get(("grad", fqn), [])
        reductions = [ranks for _, ranks, reducing in events if reducing]
        others = sorted(
            {
                f"{op} over {self.groups.name(self.rank, ranks, exp.mesh)}"
                for op, ranks, reducing in events
                if not reducing
            }
        )
        grad = param.grad
        value = None
        if grad is not None:
            local = _local(grad)
            if local.numel():
                lo, hi = float(local.min()), float(local.max())
                value = (lo, hi)
        return {
            "expected": exp,
            "reductions": reductions,
            "others": others,
            "value": value,
            "has_grad": grad is not None,
            "fires": self.fires.get(fqn, 0),
            "constant": self.constants.get(fqn),
            "tol": max(REL_TOL, 8 * torch.finfo(grad.dtype).eps) if grad is not None else REL_TOL,
        }

    def _judge(self, fqn: str, g: dict, count: float | None) -> dict:
        exp: Expected = g["expected"]
        groups, rank = self.groups, self.rank
        want = groups.group(rank, exp.mesh, exp.grad_dims)
        got = groups.closure(rank, g["reductions"])
        problems = []
        if not g["has_grad"]:
            problems.append("no gradient reached the optimizer")
        if got != want:
            problems.append(
                f"gradient summed over {groups.name(rank, got, exp.mesh)}, the plan says "
                f"{groups.name(rank, want, exp.mesh)}"
            )
        if g["others"]:
            problems.append("gradient also moved by " + ", ".join(g["others"]))
        scale = None
        if g["value"] is not None and g["fires"]:
            lo, hi = g["value"]
            scale = hi / (g["constant"] * g["fires"] * len(got))
            if not _close(lo, hi, g["tol"]):
                problems.append(f"gradient not uniform after its reductions ({lo:g} .. {hi:g})")
            elif not _close(scale, 1.0, g["tol"]):
                problems.append(
                    f"gradient scaled by {_ratio(scale)} besides its sum over {groups.name(rank, got, exp.mesh)} "
                    "(plan: a plain sum, the loss is already divided by the step's token count)"
                )
        norm_want = groups.group(rank, exp.mesh, exp.norm_dims)
        norm_got = groups.closure(rank, [r for _, r, red in self.tracer.events.get(("norm", fqn), []) if red])
        if g["has_grad"] and not norm_want <= norm_got:
            problems.append(
                f"norm summed over {groups.name(rank, norm_got, exp.mesh)}, must include "
                f"{groups.name(rank, norm_want, exp.mesh)}"
            )
        if count is not None and not _close(count, 1.0):
            problems.append(
                f"norm counts each piece {count:.3g} times (plan: once over "
                f"{groups.name(rank, norm_want, exp.mesh)}; recorded: summed over "
                f"{groups.name(rank, norm_got, exp.mesh)})"
            )
        mesh = exp.mesh
        return {
            "kind": gradient_kind(fqn),
            "grad_plan": groups.name(rank, want, mesh),
            "grad_recorded": groups.name(rank, got, mesh),
            "norm_plan": groups.name(rank, norm_want, mesh),
            "norm_recorded": groups.name(rank, norm_got, mesh),
            "norm_count": count if g["has_grad"] else "no gradient",
            "scale": scale,
            "problems": problems,
        }


def _close(a: float, b: float, tol: float = REL_TOL) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-30)


def _ratio(x: float) -> str:
    if x and not _close(x, round(x)) and _close(1 / x, round(1 / x)):
        return f"1/{round(1 / x)}"
    return f"{x:.4g}"


class GradientCheck:
    """The check over the ranks a dry run records: `watch` goes to dryrun.record_collectives,
    `report()` gathers what every rank found."""

    def __init__(self, layout: Layout, model_args):
        self.layout = layout
        self.plan = placement_plan(model_args, layout)
        self.groups = Groups(layout)
        self.ranks: list[RankResult] = []

    @contextlib.contextmanager
    def watch(self, trainer, layout: Layout, rank: int):
        with GradientWatch(trainer, layout, rank, self.plan, self.groups) as w:
            yield
        self.ranks.append(w.result)

    def report(self) -> dict:
        rows: dict[tuple, dict] = {}
        mismatches = []
        for rr in self.ranks:
            for fqn, f in rr.params.items():
                key = (
                    f["kind"],
                    f["grad_plan"],
                    f["grad_recorded"],
                    f["norm_plan"],
                    f["norm_recorded"],
                    _times(f["norm_count"]),
                )
                row = rows.setdefault(key, {"params": set(), "ranks": set(), "bad": 0})
                row["params"].add(_short(fqn))
                row["ranks"].add(rr.rank)
                row["bad"] += bool(f["problems"])
                for why in f["problems"]:
                    mismatches.append({"parameter": fqn, "rank": rr.rank, "problem": why})
        table = [
            {
                "kind": k[0],
                "grad_plan": k[1],
                "grad_recorded": k[2],
                "norm_plan": k[3],
                "norm_recorded": k[4],
                "norm_count": k[5],
                "params": sorted(v["params"]),
                "ranks": len(v["ranks"]),
                "mismatched": v["bad"],
            }
            for k, v in sorted(rows.items())
        ]
        return {"ranks": sorted(r.rank for r in self.ranks), "table": table, "mismatches": mismatches}


def _times(count) -> str:
    if isinstance(count, str):
        return count
    if count is None:
        return "not counted (max norm)"
    return "once" if _close(count, 1.0) else f"{count:.3g} times"


def _short(fqn: str) -> str:
    parts = fqn.split(".")
    return ".".join(parts[2:]) if parts[0] == "layers" else fqn


def format_gradients(rep: dict, limit: int = 20) -> list[str]:
    """One line per parameter kind and plan (the parameters that share them), then one line
    per mismatch (parameter, rank, what the plan says, what the step did)."""
    n = len(rep["ranks"])
    lines = [
        f"gradients of one step against the placement plan on {n} rank(s): "
        + ("every parameter matches" if not rep["mismatches"] else f"{len(rep['mismatches'])} MISMATCH(ES)")
    ]
    rows = [("kind", "gradient summed over: plan", "recorded", "norm: pieces over (plan)", "recorded, counted", "")]
    for r in rep["table"]:
        names = ", ".join(r["params"][:3]) + (f" (+{len(r['params']) - 3})" if len(r["params"]) > 3 else "")
        mark = "ok" if not r["mismatched"] else f"{r['mismatched']} MISMATCHED"
        rows.append(
            (
                r["kind"],
                r["grad_plan"],
                r["grad_recorded"],
                r["norm_plan"],
                f"{r['norm_recorded']}, {r['norm_count']}",
                f"{mark}: {names}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for m in rep["mismatches"][:limit]:
        lines.append(f"  MISMATCH {m['parameter']} on rank {m['rank']}: {m['problem']}")
    if len(rep["mismatches"]) > limit:
        lines.append(f"  ... and {len(rep['mismatches']) - limit} more (all in the JSON report)")
    return lines


def gradient_check(job_config, world_size: int, model_args) -> GradientCheck:
    """The check of the step record_collectives records for this job (its shrunk model)."""
    _, args = shrunk_config(job_config, model_args, world_size)
    return GradientCheck(layout_from_config(job_config, world_size), args)


def check_gradients(job_config, world_size: int, model_args, ranks=None) -> dict:
    """The gradient check of the step record_collectives records on `ranks` (None: every
    rank) -> {"gradients": the check's report, "per_group": the recorded collectives}."""
    check = gradient_check(job_config, world_size, model_args)
    per_group = record_collectives(job_config, world_size, model_args, ranks=ranks, watch=check.watch)
    return {"gradients": check.report(), "per_group": per_group}
