"""Device values brought to the host without draining the device.

`.item()` waits for everything queued before it; at the end of a step that is the optimizer's
update, and the device then idles while the host prepares the next step. HostCopies queues a
value's copy into pinned host memory where the value is computed (the loss after backward, the
gradient norm after clipping, the MoE statistics before the optimizer step), and one wait after
the optimizer's kernels are queued (the guard's after_optimizer_step) ends when the device
reaches the copies, while it still runs the update.
"""

import torch
from torch.distributed.tensor import DTensor


class HostCopies:
    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None  # recorded after the latest copy

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """t's value in pinned host memory, readable after the next wait(). A tensor that is not
        a plain CUDA tensor (on the CPU, or a DTensor) is returned as it is."""
        if isinstance(t, DTensor) or t.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return host

    def wait(self) -> None:
        """Returns once every copy queued so far has landed."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
