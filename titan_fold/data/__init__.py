"""Data: byte-level tokenizer or HF tokenizer.json; the embedded stdlib corpus or HF datasets;
layout-invariant, resumable loading (see dataloader.py)."""

from titan_fold.data.dataloader import build_dataloader
from titan_fold.data.tokenizer import ByteTokenizer, build_tokenizer

__all__ = ["ByteTokenizer", "build_dataloader", "build_tokenizer"]
