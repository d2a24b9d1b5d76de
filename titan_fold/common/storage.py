"""Files the run writes: a full disk, a read-only folder or a missing directory is one line
naming the path and the cause, not a traceback from deep inside a writer."""

import os

from titan_fold.common.errors import UserError

# below this many free bytes a failed write is put down to a full disk
LOW_SPACE = 16 * 1024**2


class StorageError(UserError, OSError):
    """A file or folder the run must write cannot be written (full disk, read-only, missing)."""


def storage_error(path: str, e: OSError) -> StorageError:
    return StorageError(f"cannot write {path}: {e.strerror or e}")


def folder_problem(folder: str) -> str | None:
    """Why `folder` cannot take writes now, or None if it looks fine (asked after a failure
    whose own message does not say, e.g. DCP's `unexpected pos 704 vs 598` on a full disk)."""
    if not os.path.isdir(folder):
        return "the folder does not exist (any more)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "read-only or no write permission"
    st = os.statvfs(folder)
    if st.f_bavail * st.f_frsize < LOW_SPACE:
        return f"no space left on the device ({st.f_bavail * st.f_frsize} bytes free)"
    return None


def storage_problem(folder: str) -> str | None:
    """folder_problem as the one line of an error: `cannot write FOLDER: CAUSE`."""
    cause = folder_problem(folder)
    return f"cannot write {folder}: {cause}" if cause else None
