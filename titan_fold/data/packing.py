"""Whole documents packed into samples of seq_len tokens, each kept apart (chat SFT).

Documents (ids with a per-token trained flag) are packed in their order, greedily: a sample
takes documents while they fit in seq_len tokens, the rest is padding. Sample g of the
endless sequence is pack g mod (number of packs), so the dataloader's global index and its
checkpointed count work as for the text stream. A document longer than seq_len is cut to it
or refused (training.long_documents) before training starts.

Documents may carry per-token fields (rollouts.py's), packed beside their tokens: a field of
the token predicted (`shift` 1: a log-probability, an advantage) lands where that token's
label does, one of the token itself (`shift` 0: its routing) where the token does. Padding
takes each field's `pad` row.
"""

import dataclasses
import hashlib

import numpy as np
import torch
from torch.utils.data import Dataset

from titan_fold.data.dataset import DataError, labels_within_documents


@dataclasses.dataclass(frozen=True)
class TokenField:
    """A per-token field of the documents: `shift` 1 = of the predicted token (aligned with the
    labels), 0 = of the token itself (aligned with the input); `pad` fills padding and the
    positions a shifted field has no value for (the last token of a document)."""

    name: str
    shift: int
    pad: np.ndarray


class PackedDocuments(Dataset):
    """Map-style dataset over all non-negative integers: item g is pack g mod len(packs).

    Returns ({"input": [seq_len], "document_ids": [seq_len]}, labels [seq_len]) int64 (no
    document_ids without document_masking: the documents then see each other); padding has its
    own document id and no labels. `fields[i]` holds document i's arrays [n_i, ...] of each
    TokenField in `token_fields`, returned under its name as [seq_len, ...].
    """

    def __init__(
        self,
        documents: list[tuple[np.ndarray, np.ndarray]],
        seq_len: int,
        long_documents: str,
        name: str,
        document_masking: bool = True,
        pad_id: int = 0,
        token_fields: tuple[TokenField, ...] = (),
        fields: list[dict[str, np.ndarray]] | None = None,
    ):
        self.seq_len, self.pad_id, self.document_masking = seq_len, pad_id, document_masking
        self.token_fields = token_fields
        self.fields = [{f.name: doc[f.name][:seq_len] for f in token_fields} for doc in fields or []]
        self.truncated = 0
        self.documents = []
        for i, (ids, trained) in enumerate(documents):
            if len(ids) > seq_len:
                if long_documents == "refuse":
                    raise DataError(
                        f"{name}: record {i} is {len(ids)} tokens, longer than training.seq_len = {seq_len} "
                        "(training.long_documents = 'truncate' cuts it instead)"
                    )
                ids, trained = ids[:seq_len], trained[:seq_len]
                self.truncated += 1
            self.documents.append((ids, trained))
        self.packs: list[list[int]] = []  # document indices of each sample
        used = seq_len
        for i, (ids, _) in enumerate(self.documents):
            if used + len(ids) > seq_len:
                self.packs.append([])
                used = 0
            self.packs[-1].append(i)
            used += len(ids)
        digest = hashlib.sha256()
        for ids, trained in self.documents:
            digest.update(ids.tobytes() + trained.tobytes())
        for doc in self.fields:
            for f in token_fields:
                digest.update(np.ascontiguousarray(doc[f.name]).tobytes())
        self.fingerprint = f"{name}:{len(self.documents)}docs:{digest.hexdigest()[:16]}"

    @property
    def trained_tokens(self) -> int:
        return int(sum(trained[1:].sum() for _, trained in self.documents))

    def __getitem__(self, g: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if g < 0:
            raise IndexError(f"sequence index {g} < 0")
        pack = self.packs[g % len(self.packs)]
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        trained = np.zeros(self.seq_len, dtype=bool)
        document_ids = np.full(self.seq_len, len(pack), dtype=np.int64)  # padding: one more document
        start = 0
        for k, i in enumerate(pack):
            doc, doc_trained = self.documents[i]
            end = start + len(doc)
            ids[start:end], trained[start:end], document_ids[start:end] = doc, doc_trained, k
            start = end
        ids, trained, document_ids = map(torch.from_numpy, (ids, trained, document_ids))
        labels = labels_within_documents(ids, trained, document_ids)
        x = {"input": ids, "document_ids": document_ids} if self.document_masking else {"input": ids}
        return {**x, **self._fields(pack)}, labels

    def _fields(self, pack: list[int]) -> dict[str, torch.Tensor]:
        """Each token field of the documents in `pack`, [seq_len, ...], at their positions."""
        out = {}
        for f in self.token_fields:
            packed = np.broadcast_to(f.pad, (self.seq_len, *f.pad.shape)).copy()
            start = 0
            for i in pack:
                values, n = self.fields[i][f.name], len(self.documents[i][0])
                packed[start : start + n - f.shift] = values[f.shift : n]
                start += n
            out[f.name] = torch.from_numpy(packed)
        return out
