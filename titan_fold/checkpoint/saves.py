"""How a save fails: a save that fails for want of storage fails on every rank alike
(`failing_save`, `agree`), and the faults the tests inject.

The fault-injection hook is read in one place (`fault`): TITAN_FOLD_FAULT_AT_STEP=k (and
TITAN_FOLD_FAULT_RANK, default 0) injects TITAN_FOLD_FAULT_KIND into that rank at step k in
the first torchrun attempt only (TORCHELASTIC_RESTART_COUNT == 0). "kill" (the default) kills
the rank with SIGKILL in the middle of step k (after forward / backward, before the optimizer
step), so `torchrun --max-restarts 1` resumes (`maybe_fault`, called by
FoldTrainer.forward_backward_step). "enospc", "efbig", "permission" and "vanished" fail the
save of step k inside DCP's writes of that rank (`SaveFault`).
"""

import contextlib
import errno
import os
import shutil
import signal
import sys
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.api import CheckpointException

from titan_fold.common.errors import UserError
from titan_fold.common.storage import StorageError, write_cause

# ---------------------------------------------------------------- faults (tests)

FAULT_STEP_ENV, FAULT_RANK_ENV, FAULT_KIND_ENV = (
    "TITAN_FOLD_FAULT_AT_STEP",
    "TITAN_FOLD_FAULT_RANK",
    "TITAN_FOLD_FAULT_KIND",
)


def fault(step: int) -> str | None:
    """The fault this rank is to suffer at `step` (the env vars above), or None."""
    at = os.environ.get(FAULT_STEP_ENV)
    if at is None or int(at) != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    if int(os.environ.get("RANK", "0")) != int(os.environ.get(FAULT_RANK_ENV, "0")):
        return None
    return os.environ.get(FAULT_KIND_ENV, "kill")


def maybe_fault(step: int) -> None:
    """Kill this process (SIGKILL: no cleanup, no flush) when the fault env vars say so."""
    if fault(step) == "kill":
        rank = int(os.environ.get("RANK", "0"))
        # said first: torchrun may report a peer's failure (its collective with this rank broke)
        # as the first one, so its own log does not always show this kill
        print(f"fault injection: SIGKILL to rank {rank} in step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class SaveFault:
    """A value saved beside the states that fails the save while this rank writes its file:
    DCP pickles non-tensor values with the file open. "enospc", "efbig" and "permission" raise
    what a full disk, a file over the file system's size limit or a folder without write
    permission raise there (a test cannot fill the disk, and root writes anywhere); "vanished"
    removes the step folder, and DCP's next write there fails by itself."""

    def __init__(self, kind: str, folder: str):
        self.kind, self.folder = kind, folder

    def __reduce__(self):
        if self.kind == "vanished":
            shutil.rmtree(self.folder)
            return (int, (0,))
        code = {"enospc": errno.ENOSPC, "efbig": errno.EFBIG, "permission": errno.EACCES}[self.kind]
        raise OSError(code, os.strerror(code), os.path.join(self.folder, "__fault"))


# ---------------------------------------------------------------- failed saves


class SaveError(StorageError):
    """A checkpoint could not be written (full disk, permissions, a folder gone); raised on every rank."""


def agree(write: Callable[[], None]) -> None:
    """Run `write` on this rank; if it fails on any rank, raise the first rank's OSError on all
    (a collective: every rank calls it)."""
    failed = None
    try:
        write()
    except OSError as e:
        failed = e
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        if failed is not None:
            raise failed
        return
    failures: list[OSError | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(failures, failed)
    first = next((e for e in failures if e is not None), None)
    if first is not None:
        raise first


def _os_error(error: BaseException | None) -> OSError | None:
    """The OSError behind `error`: itself, its cause or context, or a failed rank's (DCP's
    CheckpointException carries every failed rank's exception)."""
    while error is not None:
        if isinstance(error, OSError):
            return error
        if isinstance(error, CheckpointException):
            return next((found for _, (e, _) in sorted(error.failures.items()) if (found := _os_error(e))), None)
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def failing_save(checkpoint_id: str):
    """A save into `checkpoint_id` that fails for want of storage raises SaveError naming the
    folder and the cause; any other failure keeps its traceback."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        if isinstance(e, UserError):
            raise
        cause = write_cause(checkpoint_id, _os_error(e))
        if cause is None:
            raise
        raise SaveError(f"cannot save {checkpoint_id}: {cause}") from None
