"""metrics.jsonl: one JSON object per logged step, a faithful record across resumes.

- Every record carries `run`, the id of the launch that wrote it.
- A line is written whole: one `os.write` of the encoded line on an O_APPEND file, so it
  is in the OS's hands at once (no buffer a killed process loses half of).
- On start, a torn last line (a full disk, a kill mid-write) is cut off.
- Resuming from step-N drops the records after N, so each step appears once; a new run
  (nothing resumed) in a used folder starts a new file and keeps the old one beside it as
  `metrics.<its run id>.jsonl`.
- NaN and Inf are written as null, and the record's `nonfinite` lists those keys
  (strict JSON has no NaN).
"""

import json
import math
import os
import socket
import time

from titan_fold.common.storage import StorageError, storage_error

METRICS_FILE = "metrics.jsonl"
# metrics.expert_load's counts beside it (trainer/expert_load.py)
EXPERT_LOAD_FILE = "expert_load.jsonl"


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}-{os.getpid()}"


def encode(record: dict) -> str:
    """One line of strict JSON; non-finite floats become null and are listed in `nonfinite`."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        record = {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}
    return json.dumps(record, allow_nan=False) + "\n"


def read_records(path: str) -> list[dict]:
    """The whole lines of a metrics file (a torn last line is not a record)."""
    with open(path, "rb") as f:
        data = f.read()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


class MetricsFile:
    """`folder/metrics.jsonl`, opened by `start(resume_step)` once the trainer knows whether it resumed."""

    def __init__(self, folder: str, run_id: str | None = None):
        self.path = os.path.join(folder, METRICS_FILE)
        self.run_id = run_id or new_run_id()
        self.fd: int | None = None

    def start(self, resume_step: int) -> None:
        """resume_step: the step of the loaded checkpoint (0 when nothing was resumed)."""
        try:
            if os.path.exists(self.path):
                self._cut_torn_line()
                records = read_records(self.path)
                keep = [r for r in records if r.get("step", 0) <= resume_step]
                if resume_step > 0 and len(keep) < len(records):
                    self._rewrite(keep)
                elif resume_step == 0 and records:
                    old = records[-1].get("run") or time.strftime(
                        "%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(self.path))
                    )
                    os.replace(self.path, os.path.join(os.path.dirname(self.path), f"metrics.{old}.jsonl"))
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise storage_error(self.path, e) from None

    def _cut_torn_line(self) -> None:
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def _rewrite(self, keep: list[dict]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(encode(r) for r in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if self.fd is None:
            self.start(0)
        assert self.fd is not None  # start opened it
        line = encode({"run": self.run_id, **record}).encode()
        try:
            written = os.write(self.fd, line)
        except OSError as e:
            raise storage_error(self.path, e) from None
        if written != len(line):
            raise StorageError(f"cannot write {self.path}: only {written} of {len(line)} bytes written (disk full?)")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
