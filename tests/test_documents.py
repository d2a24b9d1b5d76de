"""Packed documents with per-document attention (training.document_masking): a packed sample
gives each document the logits and the gradients it gets alone, for GQA (Qwen3-MoE) and MLA
with YaRN (DeepSeek-V3)."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX

from titan_fold.data.dataset import Corpus, TokenWindows
from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.documents import document_mask, document_positions, one_document

LENGTHS = [5, 17, 2, 8]  # very different lengths, one of two tokens


def build(args):
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def test_positions_and_mask_of_a_packed_row():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = document_mask(ids)[0, 0].int()
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


def test_a_batch_of_one_document_samples_is_the_causal_stream():
    # the step drops such a batch's document_ids (trainer/step.py) for the faster causal kernel:
    # exact only where every sample is one document, each then starting at position 0
    assert one_document(torch.tensor([[3, 3, 3], [0, 0, 0]]))
    assert not one_document(torch.tensor([[3, 3, 3], [0, 0, 1]]))
    assert not one_document(torch.tensor([[0, 1, 1], [2, 2, 2]]))
    args = dataclasses.replace(FLAVORS["qwen3_moe"]["debug"], n_layers=2)
    model = build(args).double()
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens, document_ids=torch.full((2, 16), 7)), model(tokens), rtol=0, atol=1e-12
        )


def check_packed_equals_alone(name: str, device: str, dtype: torch.dtype, rtol: float, atol: float, grad_tol):
    # no aux loss: it pools router statistics over the batch, which packing changes by design
    args = FLAVORS[name]["debug"]
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, load_balance="none"), n_layers=2)
    model = build(args).to(device, dtype)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, args.vocab_size, (n,), generator=g).to(device) for n in LENGTHS]
    targets = [torch.randint(0, args.vocab_size, (n,), generator=g).to(device) for n in LENGTHS]

    alone_logits, alone_grads = [], []
    for doc, target in zip(docs, targets, strict=True):
        model.zero_grad()
        logits = model(doc[None])[0]
        F.cross_entropy(logits, target, reduction="sum").backward()
        alone_logits.append(logits.detach())
        alone_grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    model.zero_grad()
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None].to(device)  # [1, s]
    packed = model(torch.cat(docs)[None], document_ids=ids)[0]
    F.cross_entropy(packed, torch.cat(targets), reduction="sum").backward()

    torch.testing.assert_close(packed.detach(), torch.cat(alone_logits), rtol=rtol, atol=atol)
    for n, p in model.named_parameters():
        want = sum(grads[n] for grads in alone_grads if n in grads)
        torch.testing.assert_close(p.grad, want, rtol=grad_tol[0], atol=grad_tol[1], msg=n)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_packed_equals_each_document_alone(name):
    # float64 (the explicit-mask path); the q/k norms' weight gradients are summed over tokens in
    # float32 (layers.py), in another order
    check_packed_equals_alone(name, "cpu", torch.float64, 1e-10, 1e-10, (1e-6, 1e-8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: FlexAttention's block mask runs on CUDA")
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_packed_equals_each_document_alone_flex_on_gpu(name):
    # float32 kernels (FlexAttention against SDPA's causal one): tiling changes the rounding
    check_packed_equals_alone(name, "cuda", torch.float32, 1e-4, 1e-5, (1e-3, 1e-5))


class Docs(Corpus):
    fingerprint = "test"

    def __init__(self, docs):
        self.docs = [np.asarray(d, dtype=np.int64) for d in docs]

    def __len__(self):
        return len(self.docs)

    def tokens(self, i):
        return self.docs[i]


def test_text_windows_carry_documents_and_no_label_across_a_boundary():
    # stream 10 11 12 | 20 21 | 30 31 32 33 | (again) ..., windows of 6 + 1 tokens
    windows = TokenWindows(Docs([[10, 11, 12], [20, 21], [30, 31, 32, 33]]), seq_len=6, document_masking=True)
    x, labels = windows[0]
    assert x["input"].tolist() == [10, 11, 12, 20, 21, 30]
    assert x["document_ids"].tolist() == [0, 0, 0, 1, 1, 2]
    assert labels.tolist() == [11, 12, IGNORE_INDEX, 21, IGNORE_INDEX, 31]
    x, labels = windows[1]  # the third document's rest, then the first one again
    assert x["input"].tolist() == [32, 33, 10, 11, 12, 20]
    assert x["document_ids"].tolist() == [0, 0, 1, 1, 1, 2]
    assert labels.tolist() == [33, IGNORE_INDEX, 11, 12, IGNORE_INDEX, 21]
    plain = TokenWindows(Docs([[10, 11, 12], [20, 21], [30, 31, 32, 33]]), seq_len=6)[0]
    assert list(plain[0]) == ["input"] and plain[1].tolist() == [11, 12, 20, 21, 30, 31]


def _block_sets(mask, full: bool) -> list[list[set[int]]]:
    """Each q block's kv blocks of a BlockMask, as sets: the partial ones, or the full ones."""
    num, index = (mask.full_kv_num_blocks, mask.full_kv_indices) if full else (mask.kv_num_blocks, mask.kv_indices)
    return [[set(index[b, 0, q, : num[b, 0, q]].tolist()) for q in range(num.shape[-1])] for b in range(num.shape[0])]


@pytest.mark.parametrize("lengths", [[16] * 16, [3, 40, 1, 100, 112], [256], [1] * 40 + [216]])
def test_block_mask_from_documents_equals_flex_evaluating_every_pair(lengths):
    """flex_block_mask reads each block's first and last document; create_block_mask evaluates the
    mask at every (q, kv) pair: the partial and full kv blocks of every q block agree."""
    from torch.nn.attention.flex_attention import create_block_mask

    from titan_fold.models.documents import _mask_mod, flex_block_mask

    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ids = torch.stack([ids, ids.flip(0).neg() + ids.max()])  # [2, 256]: a second row, documents reversed
    got = flex_block_mask(ids, block=16)
    want = create_block_mask(_mask_mod(ids), 2, None, 256, 256, device="cpu", BLOCK_SIZE=16)
    for full in (False, True):
        assert _block_sets(got, full) == _block_sets(want, full)


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_every_layer_gets_positions_that_restart_in_each_document(name):
    """RoPE sees only position differences, so packed-equals-alone passes with positions that do
    not restart; here every attention layer's rotary input (cos, sin) of a packed batch is the
    table's at each token's place in its own document, counted independently."""
    args = dataclasses.replace(FLAVORS[name]["debug"], n_layers=2)
    model = build(args)
    seen = []
    for layer in model.layers.values():  # attention(x, cos, sin, mask=...)
        layer.attention.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[1:3]))
    rows = [LENGTHS, [1, 30, 1]]  # two samples of 32 tokens, documents cut differently
    ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows])  # [2, 32]
    want = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])  # [2, 32]
    with torch.no_grad():
        model(torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)), document_ids=ids)
    assert len(seen) == args.n_layers
    for cos, sin in seen:
        assert torch.equal(cos, model.rope_cos[want]) and torch.equal(sin, model.rope_sin[want])


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_mfu_counts_the_attention_within_each_document(name):
    """A packed batch's training FLOPs (the trainer's batch_flops, what MFU divides) count the
    attention the document mask lets through, not the whole sample's causal square: 12 * layers *
    heads * head_dim per (query, key) pair the mask keeps, the diagonal at half weight (the count's
    seq_len / 2 keys per query). Without documents: flops_per_token for every token."""
    from types import SimpleNamespace

    from titan_fold.trainer.fold_trainer import FoldTrainer

    args = FLAVORS[name]["debug"]
    with torch.device("meta"):
        model = Transformer(args)
    s = 32
    _, flops_per_token = args.get_nparams_and_flops(model, s)
    per_pair = 12 * (args.n_layers + args.mtp_layers) * args.n_heads * args.attention_flops_dim()
    dense = flops_per_token - per_pair * s / 2
    trainer = SimpleNamespace(dense_flops_per_token=dense, model_args=args)
    labels = torch.zeros(2, s, dtype=torch.long)
    ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in (LENGTHS, [1, 30, 1])])
    pairs = int(document_mask(ids).sum()) - ids.numel() / 2  # the diagonal at half weight
    got = FoldTrainer.batch_flops(trainer, {"document_ids": ids}, labels)
    assert got == pytest.approx(dense * ids.numel() + per_pair * pairs, rel=1e-12)
    assert FoldTrainer.batch_flops(trainer, {}, labels) == pytest.approx(flops_per_token * labels.numel(), rel=1e-12)
