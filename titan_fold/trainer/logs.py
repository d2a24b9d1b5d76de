"""Console logging of the trainer: one copy of each line, no torchtitan noise that does not apply.

- Rank 0 prints everything (INFO and up); every other rank prints only its warnings and
  errors, marked `rank N`. `LOG_RANK=0,3` (torchtitan's variable) or `LOG_RANK=all` chooses
  the ranks that print INFO lines.
- Python warnings go through the same handler (so the rank rule holds for them too).
- Colours only when stdout is a terminal (`FoldMetricsProcessor.color`).
- A filter on the handler drops a few torchtitan messages that are false or empty in
  titan_fold (see `_NOISE`); each pattern matches one message, nothing else is hidden.
"""

import logging
import os
import re
import sys
import warnings
from typing import TextIO

from torchtitan.config.job_config import Model as TitanModel
from torchtitan.tools.logging import logger

_TITAN_DEFAULT_ASSETS = re.escape(TitanModel.hf_assets_path)

# (message pattern, applies on the CPU only); why each is dropped is on its line
_NOISE = [
    # torchtitan's default hf_assets_path means "none configured" here (byte-level tokenizer)
    (rf"HF assets path {_TITAN_DEFAULT_ASSETS} does not exist!$", False),
    (rf"model\.safetensors\.index\.json not found at hf_assets_path: {_TITAN_DEFAULT_ASSETS}/", False),
    # the model-arguments dump (40 lines); the flavor name and parameter count follow in one line
    (r"Building \S+ \S+ with \{", False),
    # an NCCL variable that torchrun sets and gloo ignores
    (r"ENV\[TORCH_NCCL_ASYNC_ERROR_HANDLING\] = \S+ will be overridden", True),
    # no peak FLOPS on the CPU: MFU is not computed there (metrics.jsonl's mfu is null)
    (r"Error running lspci", True),
    (r"Peak flops undefined for: cpu", True),
    # garbage collection timings (training.gc_freq; the checkpointer's own collections)
    (r"\[GC\] ", False),
    # a save's four lines; FoldCheckpointManager.save says in one line what was saved where
    (r"Saving the checkpoint \(or staging if async is enabled\)\.$", False),
    (r"Finished saving the checkpoint \(or staging if async is enabled\) ?in \S+ seconds\.$", False),
    (r"Saving a (full|model only) checkpoint (in \S+ )?at last step, step \d+\.$", False),
    # the end of checkpoint.keep_latest_k's purge thread
    (r"Destroying the purge thread\.$", False),
]

# Python warnings that torch and torchdata raise on every CPU run, about nothing titan_fold uses
_CPU_WARNINGS = [
    r"DTensor random operators may not have complete support on cpu device mesh",
    r"DTensor manual_seed\(\) may not have complete support on cpu device mesh",
]
_WARNINGS = [
    r"'set_vital' is deprecated",
    # a pipeline stage hands its output on as `DTensor.to_local()`, a view; the warning is about
    # in-place ops on it, and neither the schedule nor the next stage writes into it
    r"FSDP2-wrapped module \(\w+\) returned a view tensor",
]


class _DropNoise(logging.Filter):
    def __init__(self, on_cpu: bool):
        super().__init__()
        self.patterns = [re.compile(p) for p, cpu_only in _NOISE if on_cpu or not cpu_only]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


class _StdoutHandler(logging.StreamHandler):
    """Writes to sys.stdout as it is when a line is logged, not when the handler was made
    (a caller that swaps sys.stdout, as pytest's capture does, may close the old one)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def info_ranks() -> str:
    """The ranks that print INFO lines: LOG_RANK, default "0"."""
    return os.environ.get("LOG_RANK", "0").replace(" ", "") or "0"


def setup_logging(device_type: str) -> None:
    """Replace torchtitan's `init_logger`: same format, one rank's INFO lines, no noise."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = info_ranks()
    verbose = ranks == "all" or str(rank) in ranks.split(",")
    who = f"rank {rank} - " if world > 1 and rank != 0 else ""

    handler = _StdoutHandler()
    handler.setLevel(logging.INFO if verbose else logging.WARNING)
    handler.setFormatter(logging.Formatter(f"[titan] %(asctime)s - {who}%(levelname)s - %(message)s"))
    handler.addFilter(_DropNoise(on_cpu=device_type == "cpu"))
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    logger.addHandler(handler)
    os.environ["KINETO_LOG_LEVEL"] = "5"  # as torchtitan's init_logger: quiet profiler

    logging.captureWarnings(True)
    for pattern in _WARNINGS + (_CPU_WARNINGS if device_type == "cpu" else []):
        warnings.filterwarnings("ignore", message=pattern)
