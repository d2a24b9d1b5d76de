"""NaN/Inf guard: a non-finite loss or gradient norm never reaches the weights or a checkpoint.

Like Megatron's --check-for-nan-in-loss-and-grad: every step, after backward and the
gradient norm and before the optimizer step, one all-reduce (MAX over all ranks) of a
two-number code tells every rank whether any rank's loss or the global gradient norm is
NaN or Inf. Then, by `training.nonfinite`:

- "stop" (default): every rank raises NonFiniteError at that step. The optimizer has not
  stepped, nothing is saved from this state; the run exits with code 3 and one line
  naming the step, the value and the last complete checkpoint.
- "skip": the optimizer step (and the lr schedule's step) is skipped on every rank, a
  warning is printed and metrics.jsonl gets `{"step": n, "skipped": "loss is nan", "skipped_steps": k}`.

The trainer feeds the guard each micro-batch's loss and the clipped norm, and calls
`before_optimizer_step` and `after_optimizer_step` around the optimizers' step (step.py:
TrainStep._update). Its cost is one 3-element all-reduce per step, and no wait for the device
where every optimizer is a fused Adam / AdamW (titan_fold's one-pass step included): the
check before the step hands them the verdict as GradScaler's `found_inf` (a device tensor:
nonzero, and their step leaves the weights, moments and step counts as they were), the
optimizer step is queued behind it, and the call after it reads the verdict once the device
has computed it, while the device runs the optimizer. It raises there, before the aux-free
router bias and the learning-rate schedule step. Other optimizers take no `found_inf`: the
check before the step waits for the verdict and raises before their step. The third element is the MoE stash's verdict (`moe.stash_rows`, moe/stash.py):
the most rows the layers needed, where more than the pool holds; then every rank raises
StashOverflow (one line naming the key), whatever the policy: the step's saved activations
were overwritten.

`check_weights` refuses a loaded checkpoint whose weights hold NaN or Inf.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer

from titan_fold.checkpoint.manager import CheckpointError
from titan_fold.common.config import ConfigError
from titan_fold.common.tensors import local
from titan_fold.moe.stash import Stash
from titan_fold.parallel.clip import divides_by_grad_scale
from titan_fold.trainer.host_copies import HostCopies
from titan_fold.trainer.optimizer import AdamOptimizersContainer

# codes, ordered so that MAX keeps the worst
FINITE, INF, NAN = 0, 1, 2
_NAMES = {INF: "inf", NAN: "nan"}


class NonFiniteError(BaseException):
    """The run stops: a non-finite loss or gradient norm at `step`. Like SystemExit it is not
    an Exception, so no `except Exception` (torchelastic's @record on torchtitan's train)
    reports it as a crash with a traceback."""

    exit_code = 3

    def __init__(self, step: int, what: str):
        super().__init__(f"step {step}: {what}")
        self.step, self.what = step, what


class StashOverflow(ConfigError):
    """The MoE layers needed more stash rows than moe.stash_rows at `step`; the optimizer has not stepped."""

    def __init__(self, step: int, rows: int, needed: int):
        super().__init__(
            f"moe.stash_rows = {rows}: the MoE layers in flight at step {step} needed {needed} rows; "
            f"set moe.stash_rows >= {needed} (stopped before that step's optimizer step)"
        )


class SkippedStep(Exception):
    """Raised around the optimizer step to skip it ("skip" policy)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def _code(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.isnan(), NAN, torch.where(x.isinf(), INF, FINITE)).amax()


class NonFiniteGuard:
    def __init__(self, policy: str, device: torch.device):
        self.policy, self.device = policy, device
        self.step = 0
        self.skipped = 0
        self._loss_code = None
        self._grad_norm = None
        self.stashes: list[Stash] = []  # the model's MoE stashes (moe/stash.py), read at every check
        self.stash_rows = 0  # moe.stash_rows, for the message
        # the torch optimizers handed the verdict as found_inf (`watch`)
        self.optimizers: list[torch.optim.Optimizer] = []
        # the verdict's codes on their way to the host, beside the trainer's logged values;
        # after_optimizer_step waits for them all
        self.copies = HostCopies()
        self._verdict = None

    def watch(self, optimizers: OptimizersContainer) -> None:
        """Guard a torchtitan OptimizersContainer's steps. Its optimizers take the verdict where its
        step is theirs (not early_step_in_backward's) and every one is a fused Adam / AdamW (they
        take GradScaler's found_inf beside its grad_scale)."""
        steps_here = type(optimizers) is OptimizersContainer or isinstance(optimizers, AdamOptimizersContainer)
        if steps_here and all(divides_by_grad_scale(opt) for opt in optimizers.optimizers):
            self.optimizers = list(optimizers.optimizers)

    def observe_loss(self, loss: torch.Tensor) -> None:
        code = _code(_value(loss).detach().float())
        self._loss_code = code if self._loss_code is None else torch.maximum(self._loss_code, code)

    def observe_grad_norm(self, norm: torch.Tensor) -> None:
        """The gradient norm of this step, as the clipping computed it."""
        self._grad_norm = _value(norm)

    def before_optimizer_step(self) -> None:
        """The verdict of every rank alike, handed to the optimizers as found_inf
        (after_optimizer_step reads it), or read now and acted on (stop, skip or go on)."""
        loss_code = self._loss_code if self._loss_code is not None else torch.tensor(FINITE)
        norm = self._grad_norm if self._grad_norm is not None else torch.zeros(())
        self._loss_code = self._grad_norm = None
        overflow = torch.zeros((), dtype=torch.int64, device=self.device)
        for stash in self.stashes:  # rows needed beyond the pool, else 0
            peak = stash.peak().to(self.device)
            overflow = torch.maximum(overflow, torch.where(peak > stash.rows, peak, 0))
        codes = torch.stack(
            [loss_code.to(self.device, torch.int64), _code(norm.float()).to(self.device, torch.int64), overflow]
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(codes, op=dist.ReduceOp.MAX)
        if not self.optimizers:
            self._act(codes.tolist())
            return
        found_inf = (codes.amax() > 0).float()  # []: the optimizers read it as a skip
        for opt in self.optimizers:
            opt.found_inf = found_inf
        self._verdict = self.copies.copy(codes)

    def after_optimizer_step(self) -> None:
        """The verdict the optimizer step was queued behind, acted on."""
        self.copies.wait()  # the optimizer's kernels are queued: the device stays busy meanwhile
        if self._verdict is None:
            return
        codes, self._verdict = self._verdict, None
        self._act(codes.tolist())

    def _act(self, codes: list[int]) -> None:
        loss_code, norm_code, needed = codes
        if needed:
            raise StashOverflow(self.step, self.stash_rows, needed)
        if loss_code == norm_code == FINITE:
            return
        what = f"loss is {_NAMES[loss_code]}" if loss_code else f"grad_norm is {_NAMES[norm_code]}"
        if self.policy == "skip":
            self.skipped += 1
            raise SkippedStep(what)
        raise NonFiniteError(self.step, what)


def _value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: under tensor parallelism without FSDP the loss (loss parallel) and the
    gradient norm are DTensors, which plain collectives do not take."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_weights(model_parts: list[torch.nn.Module], where: str) -> None:
    """Refuse weights with NaN/Inf (a diverged run's checkpoint, flipped bits) by the tensor's name."""
    bad = ""
    for part in model_parts:
        for name, p in part.named_parameters():
            shard = local(p)
            if shard.numel() and not bool(torch.isfinite(shard).all()):
                bad = name
                break
        if bad:
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        names = [""] * dist.get_world_size()  # all_gather_object fills it
        dist.all_gather_object(names, bad)
        bad = next((n for n in names if n), "")
    if bad:
        raise CheckpointError(
            f"{where} holds non-finite weights ({bad} has NaN or Inf); refusing to train from it: "
            "resume an earlier step (--checkpoint.load_step N) or delete that step folder"
        )
