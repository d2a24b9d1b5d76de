"""One trainer per dump folder: `<dump_folder>/trainer.lock`.

The launch's first rank creates the file atomically (O_EXCL) before any process group,
holding its pid, host and torchrun's run id; it removes it when the run ends. A second
trainer into the same folder fails with one line naming the folder and the holder. Other
ranks of a launch accept a lock that carries their own run id (or none yet) and fail like
the first rank otherwise. A lock whose pid is gone on this host, or that was left by an
earlier attempt of the same torchrun run (a restart), is stale and taken over; a holder on
another host cannot be checked from here, so its lock stands until it is deleted.
"""

import json
import os
import socket
import time

from titan_fold.common.errors import UserError
from titan_fold.common.storage import storage_error

LOCK_FILE = "trainer.lock"


class LockedError(UserError):
    pass


def _run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.loads(f.read() or "{}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _stale(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return False
    if holder.get("run_id") and holder.get("run_id") == _run_id():
        return True  # a crashed attempt of this torchrun run; torchrun restarts after every worker exited
    pid = holder.get("pid")
    return not isinstance(pid, int) or not _alive(pid)


def _describe(folder: str, holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (
        f"job.dump_folder {folder} is in use by another trainer (pid {holder.get('pid')} on "
        f"{holder.get('host')}, since {since}); one trainer per folder: wait for it, use another "
        f"--job.dump_folder, or delete {os.path.join(folder, LOCK_FILE)} if that run is gone"
    )


class DumpFolderLock:
    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_FILE)
        self.held = False

    def acquire(self) -> None:
        """First rank: take the lock (taking over a stale one)."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": _run_id(), "started": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                if holder is None:
                    continue  # released meanwhile
                if not _stale(holder):
                    raise LockedError(_describe(self.folder, holder)) from None
                os.remove(self.path)
                continue
            except OSError as e:
                raise storage_error(self.path, e) from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me))
            self.held = True
            return
        raise LockedError(_describe(self.folder, read_holder(self.path) or {}))

    def check(self) -> None:
        """Other ranks: the lock is free or held by this launch."""
        holder = read_holder(self.path)
        if holder and holder.get("run_id") != _run_id() and not _stale(holder):
            raise LockedError(_describe(self.folder, holder))

    def release(self) -> None:
        if self.held and (read_holder(self.path) or {}).get("pid") == os.getpid():
            os.remove(self.path)
        self.held = False
