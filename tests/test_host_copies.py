"""HostCopies (trainer/host_copies.py) and to_device (common/tensors.py): a logged step's values
reach the host, and a batch the device, without a wait for the device's queued work."""

import pytest
import torch

from titan_fold.common.tensors import to_device
from titan_fold.trainer.host_copies import HostCopies


def test_values_off_cuda_are_returned_as_they_are():
    copies = HostCopies()
    t = torch.tensor([1.5, 2.0])
    assert copies.copy(t) is t
    copies.wait()  # nothing queued: returns


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_copy_queues_behind_the_device_work_and_wait_brings_it():
    """copy() returns while the device is still busy with the work queued before it (a kernel
    that spins for about a second), and wait() returns the value that work computed. The first
    round loads the kernels and allocates the pinned block, either of which may wait for the
    device; the trainer's steps after its first are like the second."""
    copies = HostCopies()
    x = torch.zeros((), device="cuda")
    for value in (3.0, 6.0):
        torch.cuda._sleep(2_000_000_000)  # cycles: about a second at GPU clocks
        x += 3.0
        host = copies.copy(x)
        assert host.device.type == "cpu" and host.is_pinned()
        if value == 6.0:
            assert not copies._event.query()  # the device has not reached the copy: copy() did not wait
        copies.wait()
        assert host.item() == value


def test_to_device_of_a_host_tensor_on_the_host_is_the_tensor():
    t = torch.arange(4)
    assert to_device(t, torch.device("cpu")) is t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_to_device_queues_behind_the_device_work():
    """to_device returns while the device is still busy with the work queued before it, and the
    value arrives as it was at the call (the caller may reuse its tensor at once)."""
    device = torch.device("cuda")
    for value in (3, 6):  # the first round loads kernels and allocates the pinned block
        torch.cuda._sleep(2_000_000_000)  # cycles: about a second at GPU clocks
        host = torch.full((4,), value)
        moved = to_device(host, device)
        reached = torch.cuda.Event()
        reached.record()
        if value == 6:
            assert not reached.query()  # the device has not reached the copy: to_device did not wait
        host.fill_(-1)
        assert moved.device.type == "cuda" and moved.tolist() == [value] * 4
