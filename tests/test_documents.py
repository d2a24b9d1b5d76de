"""Packed documents with per-document attention (training.document_masking): a packed sample
gives each document the logits and the gradients it gets alone, for GQA (Qwen3-MoE) and MLA
with YaRN (DeepSeek-V3)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.documents import document_mask, document_positions

LENGTHS = [5, 17, 2, 8]  # very different lengths, one of two tokens


def build(args):
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model.double()


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


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_packed_equals_each_document_alone(name):
    # no aux loss: it pools router statistics over the batch, which packing changes by design
    args = FLAVORS[name]["debug"]
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, load_balance="none"), n_layers=2)
    model = build(args)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, args.vocab_size, (n,), generator=g) for n in LENGTHS]
    targets = [torch.randint(0, args.vocab_size, (n,), generator=g) for n in LENGTHS]

    alone_logits, alone_grads = [], []
    for doc, target in zip(docs, targets):
        model.zero_grad()
        logits = model(doc[None])[0]
        F.cross_entropy(logits, target, reduction="sum").backward()
        alone_logits.append(logits.detach())
        alone_grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    model.zero_grad()
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None]  # [1, s]
    packed = model(torch.cat(docs)[None], document_ids=ids)[0]
    F.cross_entropy(packed, torch.cat(targets), reduction="sum").backward()

    torch.testing.assert_close(packed.detach(), torch.cat(alone_logits), rtol=1e-10, atol=1e-10)
    for n, p in model.named_parameters():
        want = sum(grads[n] for grads in alone_grads if n in grads)
        # the q/k norms' weight gradients are summed over tokens in float32 (layers.py), in another order
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-8, msg=n)
