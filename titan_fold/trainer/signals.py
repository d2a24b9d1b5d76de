"""Stop requests: SIGTERM / SIGUSR1 (save, exit 143) and SIGINT (Ctrl-C: no save, exit 130).

A handler only records the signal; the trainer asks `agreed()` at the end of every step,
an all-reduce (MAX) over all ranks, so every rank stops after the same step even when only
some got the signal (torchrun forwards SIGTERM/SIGINT to every worker; a terminal's Ctrl-C
reaches them directly too, so a worker often sees SIGINT twice). The all-reduce queued at one
step is read at the next, through a pinned host copy: reading it at once would make the host
wait for the step the device is running, every step. So a request made during step N stops
every rank after step N + 1 (after step N on one rank, which has nothing to agree on). A save
that is running when a signal arrives is never cut: the handler returns and the step finishes.

- SIGTERM (what schedulers and `torchrun` send) and SIGUSR1 (SLURM's warning before the end
  of a job): the step finishes, a complete checkpoint of it is saved (when
  checkpoint.enable), one line is printed, and the process exits with 143 (128 + SIGTERM),
  so `torchrun --max-restarts N` or the scheduler restarts it from exactly that step.
- SIGINT: the step finishes, nothing more is saved, one line names the last complete
  checkpoint, exit code 130 (128 + SIGINT).
"""

import os
import signal
from types import FrameType

import torch
import torch.distributed as dist

from titan_fold.trainer.host_copies import HostCopies

NONE, INTERRUPT, PREEMPT = 0, 1, 2  # MAX keeps the stronger request
EXIT_CODES = {INTERRUPT: 130, PREEMPT: 143}
_KIND: dict[int, int] = {signal.SIGINT: INTERRUPT, signal.SIGTERM: PREEMPT, signal.SIGUSR1: PREEMPT}


class StopRequested(BaseException):
    """Every rank leaves the training loop after `step` because of a signal (a BaseException,
    like KeyboardInterrupt: not a crash for torchelastic's @record)."""

    def __init__(self, kind: int, step: int):
        super().__init__(f"stop requested after step {step}")
        self.kind, self.step = kind, step
        self.exit_code = EXIT_CODES[kind]


class StopSignals:
    def __init__(self) -> None:
        self.kind = NONE
        self.name = ""
        self._pending: tuple[HostCopies, torch.Tensor] | None = None  # the previous call's agreed request

    def install(self) -> None:
        for sig in _KIND:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if _KIND[signum] >= self.kind:
            self.kind, self.name = _KIND[signum], signal.Signals(signum).name

    def agreed(self, device: torch.device) -> int:
        """The strongest request any rank had made at the previous call (a collective: every rank
        calls it at the same step; NONE at the first call); on one rank, its request now."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.kind
        kind = torch.tensor([self.kind], dtype=torch.int64, device=device)
        dist.all_reduce(kind, op=dist.ReduceOp.MAX)
        copies = HostCopies()
        pending, self._pending = self._pending, (copies, copies.copy(kind))
        if pending is None:
            return NONE
        pending[0].wait()
        return int(pending[1].item())


def last_complete_checkpoint(folder: str) -> str | None:
    """The newest `step-N` under `folder` whose save finished (DCP's `.metadata` exists)."""
    from titan_fold.checkpoint.manager import complete

    try:
        steps = [int(d[5:]) for d in os.listdir(folder) if d.startswith("step-") and d[5:].isdigit()]
    except OSError:
        return None
    done = [s for s in steps if complete(os.path.join(folder, f"step-{s}"))]
    return f"step-{max(done)}" if done else None
