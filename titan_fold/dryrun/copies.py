"""The gradient check's part for copies of hot experts (`moe.hot_expert_replicas`, moe/replicas.py):
a copy's gradient must be summed over the dims the placement plan gives it (`Placed.copies_grad`:
ep), once, and reach its home expert's gradient, once, before that gradient's own reductions
(which dryrun/gradients.py checks against the plan).

The dry run's counts (dryrun/fake_counts.py) show each layer's copies as they are made: the
copies, and an alias of the weights they are read from. On the recorded step:

- each copy's incoming gradient is replaced by a constant c (from the weight's name) and tagged,
  so the tracer records the collectives that carry it;
- the alias sees the copies' share of the weight's gradient alone: on the rows of the nominees
  this rank holds it must read ep x c (the fake group's sum over ep of c), elsewhere 0;
- the tagged gradient must have been reduced once per backward pass, over exactly the ep group,
  and moved by no other collective.

A dropped copy gradient leaves the home rows without it; one counted twice reads 2 x ep x c or
shows two reductions.
"""

from collections import defaultdict
from functools import partial

import torch

from titan_fold.moe import moe_layers
from titan_fold.parallel.mesh import Layout
from titan_fold.parallel.reductions import Groups

KIND = "expert copies"


class CopyGradients:
    """One simulated rank's copies: hooks installed with `install`, findings from `judge`."""

    def __init__(self, tracer, layout: Layout, groups: Groups, rank: int, constant_of, plan: dict):
        self.tracer, self.layout, self.groups, self.rank, self.plan = tracer, layout, groups, rank, plan
        self.constant_of = constant_of
        self.fires: dict[str, int] = defaultdict(int)
        self.arrivals: dict[str, list[str]] = defaultdict(list)  # fqn -> what each arrival got wrong ("" = right)
        self.constants: dict[str, float] = {}
        self.events: dict[str, list] = {}  # fqn -> the collectives that carried its copies' gradient home
        # the weights of this rank's stage the placement plan gives copies, and those whose layers
        # made them in the step
        self.planned: list[str] = []
        self.watched: set[str] = set()

    def install(self, model_parts, names: dict[int, str], params: list[str]) -> None:
        self.planned = [fqn for fqn in params if self.plan[fqn].copies_grad]
        for moe in moe_layers(model_parts):
            counts = moe.dispatcher.counts
            if moe.args.hot_expert_replicas and moe.dispatcher.ep > 1 and hasattr(counts, "on_copies"):
                prefix = names[id(moe.experts)]
                counts.on_copies = partial(self._watch, prefix)

    def _watch(self, prefix: str, name: str, held: torch.Tensor, out: torch.Tensor, rows: torch.Tensor) -> None:
        fqn = f"{prefix}.{name}"
        self.watched.add(fqn)
        tag = f"{fqn} copies"
        ep = self.layout.size("ep")
        c = self.constant_of(tag, out.numel(), ep)
        self.constants[fqn] = float(torch.tensor(c, dtype=out.dtype))

        def replace(grad):
            self.fires[fqn] += 1
            local = torch.full_like(grad, c)
            self.tracer.tag(local, [tag])
            return local

        def arrive(grad):
            if grad is None:  # nothing reached the weights
                return
            home = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
            home[rows] = True
            self.arrivals[fqn].append(_arrival(grad, home, ep * self.constants[fqn]))
            # the collectives before it reached home: after that it is the weight's gradient
            self.events[fqn] = list(self.tracer.events.get(("grad", tag), []))

        out.register_hook(replace)
        held.register_hook(arrive)

    def judge(self) -> dict[str, dict]:
        """fqn + ' copies' -> findings in the shape of dryrun/gradients.py's table rows."""
        found = {}
        for fqn in sorted(set(self.planned) | self.watched):
            tag = f"{fqn} copies"
            want = self.groups.group(self.rank, "expert", self.plan[fqn].copies_grad)
            events = self.events.get(fqn, [])
            reductions = [ranks for _, ranks, reducing in events if reducing]
            got = self.groups.closure(self.rank, reductions)
            problems = []
            fires = self.fires.get(fqn, 0)
            plan = " x ".join(self.plan[fqn].copies_grad) or "none"
            if fqn not in self.watched:
                problems.append(f"the plan has copies summed over {plan}, the layer made none")
            elif fqn not in self.planned:
                problems.append("the layer made copies the plan does not have")
            elif not fires:
                problems.append("no copy had a gradient")
            if fqn in self.planned and (got != want or len(reductions) != fires):
                problems.append(
                    f"copies' gradient summed {len(reductions)} time(s) over "
                    f"{self.groups.name(self.rank, got, 'expert')} in {fires} backward pass(es); "
                    f"the plan says once over {plan}"
                )
            others = sorted({op for op, _, reducing in events if not reducing})
            if others:
                problems.append("copies' gradient also moved by " + ", ".join(others))
            problems += sorted({why for why in self.arrivals.get(fqn, []) if why})
            if fires and len(self.arrivals.get(fqn, [])) != fires:
                problems.append(
                    f"copies' gradient reached the home expert {len(self.arrivals.get(fqn, []))} time(s) "
                    f"in {fires} backward pass(es)"
                )
            name = self.groups.name(self.rank, got, "expert")
            found[tag] = {
                "kind": KIND,
                "grad_plan": self.groups.name(self.rank, want, "expert"),
                "grad_recorded": name,
                "norm_plan": "none (not a parameter)",
                "norm_recorded": "none",
                "norm_count": "not counted",
                "scale": None,
                "problems": problems,
            }
        return found


def _arrival(grad: torch.Tensor, home: torch.Tensor, value: float) -> str:
    """What the copies' share of a weight's gradient got wrong ("" if nothing): `value` on the rows
    of the nominees this rank holds (`home`), 0 elsewhere."""
    g = grad.detach().double().reshape(grad.shape[0], -1)
    if (~home).any() and bool(g[~home].abs().max() > 0):
        return "copies' gradient landed on rows of experts that were not copied"
    if home.any():
        lo, hi = float(g[home].min()), float(g[home].max())
        tol = max(1e-4, 8 * torch.finfo(grad.dtype).eps)
        if abs(hi - lo) > tol * abs(value) or abs(hi - value) > tol * abs(value):
            return f"copies' gradient reached the home expert x {hi / value:.3g} (plan: once)"
    return ""
