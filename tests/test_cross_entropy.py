"""The token cross-entropy (common/cross_entropy.py) against torch's F.cross_entropy in float64,
its autograd wiring, where it hands over to F.cross_entropy, the loss the TrainSpec builds, and
on a GPU its generated kernels against torchtitan's loss."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torchtitan.components.loss import cross_entropy_loss

from titan_fold.common.cross_entropy import IGNORE_INDEX, _backward, _CrossEntropy, _forward, token_cross_entropy
from titan_fold.trainer.train_spec import build_loss


def _case(n=37, vocab=101, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, vocab, generator=g)).to(device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (n,), generator=g).to(device)
    labels[::5] = IGNORE_INDEX
    return logits, labels


def _reference(logits, labels, grad=1.0):
    # float64 loss and gradient of the sum over the labels not ignored
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (loss * grad).backward()
    return loss.detach(), x.grad


def test_forward_and_backward_math_match_float64():
    logits, labels = _case()
    want_loss, want_grad = _reference(logits, labels, grad=0.5)
    loss, lse = _forward(logits, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double(), -1), rtol=1e-6, atol=0)
    grad = _backward(torch.tensor(0.5), logits, labels, lse)
    assert grad.dtype == logits.dtype
    torch.testing.assert_close(grad.double(), want_grad, rtol=0, atol=1e-6)
    assert grad[::5].abs().max() == 0  # ignored labels: no gradient


def test_autograd_function_rounds_the_gradient_once_like_torch():
    """Through the autograd Function (its kernels run as written on the CPU), bf16 logits: the loss
    and the bf16 gradient of torch's float32 path (cast the logits up, F.cross_entropy, back down)."""
    logits, labels = _case(dtype=torch.bfloat16)
    ours = logits.clone().requires_grad_()
    loss = _CrossEntropy.apply(ours, labels)
    loss.backward()
    theirs = logits.clone().requires_grad_()
    want = F.cross_entropy(theirs.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert ours.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=2**-7, atol=1e-6)  # one bf16 rounding apart at most


def test_all_labels_ignored_give_zero():
    logits, labels = _case()
    labels[:] = IGNORE_INDEX
    x = logits.clone().requires_grad_()
    loss = _CrossEntropy.apply(x, labels)
    loss.backward()
    assert loss.item() == 0 and x.grad.abs().max() == 0


def test_cpu_runs_torchtitans_loss():
    """On the CPU token_cross_entropy is torchtitan's cross_entropy_loss, bit for bit, on [b, s, vocab]."""
    logits, labels = _case(n=24)
    logits, labels = logits.view(2, 12, -1), labels.view(2, 12)
    assert torch.equal(token_cross_entropy(logits, labels), cross_entropy_loss(logits, labels))


@pytest.mark.parametrize("enable,components,ours", [(False, ["model", "loss"], True), (True, ["model"], True),
                                                      (True, ["model", "loss"], False)])
def test_trainspec_loss(enable, components, ours):
    """The TrainSpec's loss: torchtitan's compiled one where compile.components holds "loss",
    token_cross_entropy otherwise."""
    config = SimpleNamespace(compile=SimpleNamespace(enable=enable, components=components, backend="inductor"))
    assert (build_loss(config) is token_cross_entropy) == ours


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_generated_kernels_match_torchtitans_loss_on_cuda():
    """bf16 logits [2, 256, 50000] on CUDA through the generated kernels against torchtitan's loss."""
    logits, labels = _case(n=512, vocab=50000, dtype=torch.bfloat16, device="cuda")
    logits, labels = logits.view(2, 256, -1), labels.view(2, 256)
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, want = token_cross_entropy(ours, labels), cross_entropy_loss(theirs, labels)
    (loss / 7).backward()
    (want / 7).backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=2**-7, atol=1e-7)
    assert ours.grad.view(-1, 50000)[::5].abs().max() == 0
