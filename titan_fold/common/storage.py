"""Files the run writes: a full disk, a read-only folder or a path through a file is
one line naming the path and the cause, not a traceback from deep inside a writer.

A failed write is named by its errno (CAUSES, the one map from errno to words), and by the
folders on its way where they show where the fault is (`write_cause`). The same look at the
folders checks job.dump_folder and the checkpoint folder before any work (`folder_problem`):
every rank makes it alike, so whichever rank fails first says the same line.
"""

import errno
import os

from titan_fold.common.errors import UserError

# below this many free bytes a failed write is put down to a full disk
LOW_SPACE = 16 * 1024**2

# a failed write's errno -> its cause, as the error line says it
CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "a file larger than the file system allows",
    errno.EACCES: "no write permission",
    errno.EPERM: "no write permission",
    errno.EROFS: "a read-only file system",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.ENOENT: "the folder does not exist (any more)",
}
# the causes a look at the folders places (which folder refuses writes, which part is a file)
PLACED = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)


class StorageError(UserError, OSError):
    """A file or folder the run must write cannot be written (full disk, read-only, missing)."""


def _nearest_existing(path: str) -> str:
    """`path` (made absolute) or its nearest ancestor that exists: where `path` would be made."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def folder_problem(folder: str, made: bool = False) -> str | None:
    """Why `folder` cannot take writes, or None if it looks fine. A folder not made yet is
    judged where it would be made (its nearest existing ancestor); `made`: it was made
    earlier, so missing is a fault."""
    at = _nearest_existing(folder)
    if not os.path.isdir(at):
        return f"{at} is a file, not a folder"
    if made and at != os.path.abspath(folder):
        return CAUSES[errno.ENOENT]
    try:
        st: os.statvfs_result | None = os.statvfs(at)
    except OSError:  # a file system that keeps no such numbers: judged by permission alone
        st = None
    if st is not None and st.f_flag & os.ST_RDONLY:
        return f"{at} is on {CAUSES[errno.EROFS]}"
    if not os.access(at, os.W_OK | os.X_OK):
        return f"{CAUSES[errno.EACCES]} in {at}"
    if st is not None and st.f_bavail * st.f_frsize < LOW_SPACE:
        return f"{CAUSES[errno.ENOSPC]} ({st.f_bavail * st.f_frsize} bytes free)"
    return None


def write_cause(folder: str, error: OSError | None) -> str | None:
    """Why a write into `folder` failed with `error`: its errno's cause, placed by the folders
    where they show it; for an error without a known errno (DCP's `unexpected pos 704 vs 598`
    on a full disk) what the folders show, else its own words; None: nothing points at storage."""
    code = error.errno if error is not None else None
    shown = folder_problem(folder)
    if shown and code in PLACED:
        return shown
    if code in CAUSES:
        return CAUSES[code]
    if shown or error is None:
        return shown
    return error.strerror or str(error)


def storage_error(path: str, e: OSError) -> StorageError:
    """The one line of a failed write of the file at `path`."""
    return StorageError(f"cannot write {path}: {write_cause(os.path.dirname(path), e)}")


def storage_problem(folder: str) -> str | None:
    """The one line of an error about `folder`, made earlier, after a failure whose own error
    does not say (`cannot write FOLDER: CAUSE`), or None if the folder looks fine."""
    cause = folder_problem(folder, made=True)
    return f"cannot write {folder}: {cause}" if cause else None
