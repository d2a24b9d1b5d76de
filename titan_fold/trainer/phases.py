"""Where a logged step's time goes (`metrics.step_phases = true`): host and GPU milliseconds per
phase, in metrics.jsonl (`phases`) and the step line.

A profiler trace adds host work to every op, so a step that keeps its GPU busy untraced can look
host-bound traced. Here each phase boundary reads the host's clock and records a CUDA event on
the current stream. A phase's GPU time is the time between its two events: its kernels and any
wait for the host to queue them. Where a phase's GPU time is about its host time, the host paced
it (host-bound); where it is more, the GPU did and the host ran ahead. The events are read when
the step is logged, after the logging's own host sync: no sync is added, and steps that are not
logged record nothing.

The phases, each summed over the step's micro-batches:
  data      the step's batches loaded and each moved to the device (and what runs between the
            last micro-batch's backward and the clip)
  forward   the model's forward; `forward_backward` where a pipeline schedule or overlapped
            micro-batches (moe.ep_overlap "batch") interleave forward and backward
  backward  the loss and backward
  clip      the gradient norm (the NaN/Inf guard's check of it included)
  optimizer the optimizers' step, the model converters' work after it, the guard's reading of
            its verdict and the aux-free expert bias's update (step.py: TrainStep._update)
  rest      what follows until the step is logged: learning-rate schedule, the loss's reduction
"""

import itertools
import time
from typing import TypedDict

import torch


class PhaseTimes(TypedDict):
    host_ms: float
    gpu_ms: float | None  # None without CUDA


class StepPhases:
    def __init__(self, device: torch.device):
        self.events = device.type == "cuda" and torch.cuda.is_available()
        # while a logged step runs: (the phase starting here, host seconds, CUDA event or None)
        self.marks: list[tuple[str, float, torch.cuda.Event | None]] | None = None

    def start(self) -> None:
        """A step that will be logged starts (its first phase: data)."""
        self.marks = []
        self.mark("data")

    def mark(self, phase: str) -> None:
        """`phase` starts now (nothing outside a started step)."""
        if self.marks is None:
            return
        event = None
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((phase, time.perf_counter(), event))

    def finish(self) -> dict[str, PhaseTimes] | None:
        """Ends the started step's last phase -> {phase: {"host_ms", "gpu_ms"}} in the order the
        phases first ran (gpu_ms None without CUDA), or None where no step was started."""
        if self.marks is None:
            return None
        self.mark("")
        marks, self.marks = self.marks, None
        last = marks[-1][2]
        if last is not None:
            last.synchronize()  # the one wait the option adds: for the step's last kernels
        host: dict[str, float] = {}
        gpu: dict[str, float] = {}
        for (phase, t0, e0), (_, t1, e1) in itertools.pairwise(marks):
            host[phase] = host.get(phase, 0.0) + 1e3 * (t1 - t0)
            if e0 is not None and e1 is not None:
                gpu[phase] = gpu.get(phase, 0.0) + e0.elapsed_time(e1)
        return {phase: {"host_ms": ms, "gpu_ms": gpu.get(phase)} for phase, ms in host.items()}


def phases_text(phases: dict[str, PhaseTimes]) -> str:
    """The step line's part: `phases ms host/GPU data H/G forward H/G ...` (host only without CUDA)."""

    def ms(v: float) -> str:
        return f"{v:.1f}" if v < 10 else f"{v:.0f}"

    parts = [
        f"{name} {ms(p['host_ms'])}" + ("" if p["gpu_ms"] is None else f"/{ms(p['gpu_ms'])}")
        for name, p in phases.items()
    ]
    gpu = any(p["gpu_ms"] is not None for p in phases.values())
    return f"phases ms {'host/GPU' if gpu else 'host'} " + " ".join(parts)
