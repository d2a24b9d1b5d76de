"""Documents -> one framed token stream -> fixed windows named by a global index.

Every document is tokenized as BOS ... EOS and the documents are concatenated in a fixed
order into a stream of L tokens, repeated forever (epoch e is positions [e*L, (e+1)*L)).
Sequence g is the window of seq_len+1 tokens starting at g*(seq_len+1) (input = w[:-1],
labels = w[1:]). A sequence is one integer, whatever the parallel layout: the sampler in
dataloader.py decides which integers a dp rank reads.

With document masking (training.document_masking) an item also carries each token's document
(document_ids: a number per piece of a document in the window) and no label on the token that
crosses into the next document.

Lengths are found lazily: the stream only tokenizes documents up to the furthest position
asked for (a byte-level corpus knows its lengths from file sizes and reads nothing it skips).
"""

import bisect
import os
import sysconfig
from abc import ABC, abstractmethod
from collections import OrderedDict

import numpy as np
import torch
from torch.utils.data import Dataset
from torchtitan.components.loss import IGNORE_INDEX

from titan_fold.common.errors import UserError
from titan_fold.data.tokenizer import ByteTokenizer


class DataError(UserError, ValueError):
    """training.dataset / dataset_path cannot give data; the message names the key and the path."""


# directory names left out of the stdlib corpus: other packages, test suites, caches
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files(root: str) -> list[tuple[str, int]]:
    """(relative path, size) of the standard library's .py files, sorted by path.

    Left out: other packages, test suites, empty files, and files written for this build
    (_sysconfigdata_*.py, config-*/) whose contents name the machine.
    """
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _STDLIB_SKIP_DIRS and not x.startswith((".", "config-"))]
        for name in names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = os.path.join(d, name)
                size = os.stat(path).st_size
                if size > 0:
                    files.append((os.path.relpath(path, root).replace(os.sep, "/"), size))
    return sorted(files)


def labels_within_documents(ids: torch.Tensor, trained: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[s] labels: the next token where it is trained and in the same document, else IGNORE_INDEX."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    keep = trained[1:] & (document_ids[1:] == document_ids[:-1])
    labels[:-1] = torch.where(keep, ids[1:], IGNORE_INDEX)
    return labels


class Corpus(ABC):
    """An ordered list of documents; document i tokenizes to BOS ... EOS (or nothing if empty)."""

    fingerprint: str  # names the corpus in checkpoints

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def tokens(self, i: int) -> np.ndarray:
        """[n_i] int64 token ids of document i, framed."""

    def lengths(self) -> list[int] | None:
        """Token counts of all documents when known without tokenizing, else None."""
        return None


def _encode(tokenizer, text: str | bytes) -> np.ndarray:
    if not text:
        return np.empty(0, dtype=np.int64)
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode_array(text, add_bos=True, add_eos=True)
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return np.asarray(tokenizer.encode(text, add_bos=True, add_eos=True), dtype=np.int64)


class StdlibCorpus(Corpus):
    """The Python standard library's own .py sources on this machine (see stdlib_files)."""

    def __init__(self, tokenizer, root: str | None = None):
        self.root = root or sysconfig.get_paths()["stdlib"]
        self.tokenizer = tokenizer
        self.files = stdlib_files(self.root)
        if not self.files:
            raise FileNotFoundError(f"training.dataset = 'stdlib': no .py files under {self.root}")
        self.fingerprint = f"stdlib:{len(self.files)}files:{sum(s for _, s in self.files)}bytes"

    def __len__(self) -> int:
        return len(self.files)

    def tokens(self, i: int) -> np.ndarray:
        rel, size = self.files[i]
        with open(os.path.join(self.root, rel), "rb") as f:
            data = f.read()
        if len(data) != size:
            raise RuntimeError(f"stdlib corpus: {rel} changed size while training ({size} -> {len(data)} bytes)")
        return _encode(self.tokenizer, data)

    def lengths(self) -> list[int] | None:
        if isinstance(self.tokenizer, ByteTokenizer):
            return [size + 2 for _, size in self.files]
        return None


class HFTextCorpus(Corpus):
    """Rows of a map-style HF `datasets.Dataset`, one document per row of `column`."""

    def __init__(self, ds, tokenizer, fingerprint: str, column: str = "text"):
        self.ds = ds.select_columns([column])
        self.column = column
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint

    def __len__(self) -> int:
        return len(self.ds)

    def tokens(self, i: int) -> np.ndarray:
        return _encode(self.tokenizer, self.ds[i][self.column])


class TokenWindows(Dataset):
    """Map-style dataset over all non-negative integers: item g is sequence g of the stream.

    Returns ({"input": [seq_len]}, labels [seq_len]) int64, with document_masking also
    "document_ids": [seq_len].
    """

    def __init__(self, corpus: Corpus, seq_len: int, cache_docs: int = 64, document_masking: bool = False):
        self.corpus = corpus
        self.seq_len = seq_len
        self.document_masking = document_masking
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_docs = cache_docs
        lengths = corpus.lengths()
        # _ends[i] = stream position just past document i, for the documents measured so far
        self._ends: list[int] = np.cumsum(lengths).tolist() if lengths is not None else []
        self._total: int | None = None  # L, once every document is measured
        self._measured_all()

    def _measured_all(self) -> None:
        if len(self._ends) == len(self.corpus):
            self._total = self._ends[-1] if self._ends else 0
            if self._total == 0:
                raise DataError(f"training.dataset_path: {self.corpus.fingerprint} holds no tokens")

    def _doc(self, i: int) -> np.ndarray:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        tokens = self.corpus.tokens(i)
        self._cache[i] = tokens
        if len(self._cache) > self._cache_docs:
            self._cache.popitem(last=False)
        return tokens

    def _locate(self, pos: int) -> tuple[int, int]:
        """(document, offset in it) of stream position pos, wrapping over epochs."""
        while self._total is None and (not self._ends or self._ends[-1] <= pos):
            n = len(self._doc(len(self._ends)))
            self._ends.append((self._ends[-1] if self._ends else 0) + n)
            self._measured_all()
        if self._total is not None:
            pos %= self._total
        i = bisect.bisect_right(self._ends, pos)  # skips empty documents
        return i, pos - (self._ends[i - 1] if i else 0)

    @property
    def total_tokens(self) -> int | None:
        """L, the tokens of one epoch, once known (at start for byte-level stdlib)."""
        return self._total

    @property
    def fingerprint(self) -> str:
        return self.corpus.fingerprint

    def window(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[seq_len + 1] int64: stream positions [g*(seq_len+1), (g+1)*(seq_len+1)), and the
        index [seq_len + 1] of the document piece each comes from (0, 1, ... in the window)."""
        if g < 0:
            raise IndexError(f"sequence index {g} < 0")
        n = self.seq_len + 1
        pos, parts = g * n, []
        while n:
            i, off = self._locate(pos)
            part = self._doc(i)[off : off + n]
            parts.append(part)
            pos, n = pos + len(part), n - len(part)
        pieces = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor([len(p) for p in parts]))
        return torch.from_numpy(np.concatenate(parts)), pieces

    def __getitem__(self, g: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w, pieces = self.window(g)
        if not self.document_masking:
            return {"input": w[:-1]}, w[1:]
        labels = labels_within_documents(w, torch.ones_like(w, dtype=torch.bool), pieces)
        return {"input": w[:-1], "document_ids": pieces[:-1]}, labels[:-1]
