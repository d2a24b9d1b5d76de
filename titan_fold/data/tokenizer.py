"""Tokenizers: a byte-level default that needs no file, or a HF tokenizer.json from hf_assets_path."""

import os

import numpy as np
from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer
from torchtitan.config.job_config import Model as TitanModel

from titan_fold.common.errors import UserError

# torchtitan's default hf_assets_path; a missing folder at this value means "not configured"
_TITAN_DEFAULT_ASSETS = TitanModel.hf_assets_path
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")


class TokenizerNotFound(UserError, FileNotFoundError):
    """model.hf_assets_path holds no tokenizer: one line in a real run; a dry run, whose
    folder may exist only on the cluster, warns instead (a FileNotFoundError to preflight)."""


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes are the ids 0..255; BOS = 256, EOS = 257 (vocab 258)."""

    def __init__(self):
        super().__init__()
        self.bos_id = 256
        self.eos_id = 257

    def encode(self, text: str | bytes, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self.encode_array(text, add_bos, add_eos).tolist()

    def encode_array(self, text: str | bytes, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        ids = np.empty(len(data) + add_bos + add_eos, dtype=np.int64)  # [n]
        ids[int(add_bos) : int(add_bos) + len(data)] = np.frombuffer(data, dtype=np.uint8)
        if add_bos:
            ids[0] = self.bos_id
        if add_eos:
            ids[-1] = self.eos_id
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Bytes back to text (invalid UTF-8 becomes U+FFFD); BOS/EOS are dropped, or shown
        as <s> and </s> with skip_special_tokens=False."""
        out, run = [], bytearray()
        for i in (int(t) for t in ids):
            if i < 256:
                run.append(i)
                continue
            if i not in (self.bos_id, self.eos_id):
                raise ValueError(
                    f"ByteTokenizer.decode: id {i} is outside the vocabulary (0..{self.get_vocab_size() - 1})"
                )
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append("<s>" if i == self.bos_id else "</s>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def get_vocab_size(self) -> int:
        return 258

    @property
    def vocab_size(self) -> int:
        return self.get_vocab_size()


def build_tokenizer(job_config) -> BaseTokenizer:
    """HF tokenizer when `model.hf_assets_path` holds tokenizer files, else ByteTokenizer.

    torchtitan's default path (./tests/assets/tokenizer) that does not exist means "none
    configured"; any other path must exist and hold tokenizer.json (or vocab.json/vocab.txt).
    """
    path = job_config.model.hf_assets_path
    if not path or (path == _TITAN_DEFAULT_ASSETS and not os.path.exists(path)):
        return ByteTokenizer()
    if not os.path.isdir(path):
        raise TokenizerNotFound(
            f"model.hf_assets_path = '{path}': no such folder (unset it for the byte-level tokenizer)"
        )
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise TokenizerNotFound(
            f"model.hf_assets_path = '{path}' holds none of {list(_TOKENIZER_FILES)} "
            f"(found {sorted(os.listdir(path))}); unset it for the byte-level tokenizer"
        )
    return HuggingFaceTokenizer(path)
