"""Whole documents packed into samples of seq_len tokens, each kept apart (chat SFT).

Documents (ids with a per-token trained flag) are packed in their order, greedily: a sample
takes documents while they fit in seq_len tokens, the rest is padding. Sample g of the
endless sequence is pack g mod (number of packs), so the dataloader's global index and its
checkpointed count work as for the text stream. A document longer than seq_len is cut to it
or refused (training.long_documents) before training starts.
"""

import hashlib

import numpy as np
import torch
from torch.utils.data import Dataset

from titan_fold.data.dataset import DataError, labels_within_documents


class PackedDocuments(Dataset):
    """Map-style dataset over all non-negative integers: item g is pack g mod len(packs).

    Returns ({"input": [seq_len], "document_ids": [seq_len]}, labels [seq_len]) int64 (no
    document_ids without document_masking: the documents then see each other); padding has its
    own document id and no labels.
    """

    def __init__(
        self,
        documents: list[tuple[np.ndarray, np.ndarray]],
        seq_len: int,
        long_documents: str,
        name: str,
        document_masking: bool = True,
        pad_id: int = 0,
    ):
        self.seq_len, self.pad_id, self.document_masking = seq_len, pad_id, document_masking
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
        return ({"input": ids, "document_ids": document_ids} if self.document_masking else {"input": ids}), labels
