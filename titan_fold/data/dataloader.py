"""Layout-invariant data loading: dp rank r reads its slice of the global batch.

With local batch b and dp degree D, micro-batch c of dp rank r is the sequences
[start + c*b*D + r*b, start + c*b*D + (r+1)*b). With gradient accumulation
A = global_batch / (b*D), step s reads micro-batches s*A .. s*A+A-1 on every rank, i.e.
exactly the sequences [start + s*G, start + (s+1)*G) for every (D, b) with the same G.
The checkpointed state is that one global count, so a run may resume with another layout.
"""

import os
from dataclasses import asdict, fields

import torch
from torch.utils.data import Sampler
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from titan_fold.common.config import Training
from titan_fold.common.rules import documents_masked
from titan_fold.data.chat import chat_template, read_conversations, text_encoder, tokenize_conversation
from titan_fold.data.dataset import DataError, HFTextCorpus, StdlibCorpus, TokenWindows
from titan_fold.data.packing import PackedDocuments
from titan_fold.data.rollouts import RoutingShape, read_rollouts, rollout_fields

DATASETS = ("stdlib", "hf", "chat_example", "rollouts_example")
# the embedded example conversations (training.dataset = "chat_example") and rollouts
# ("rollouts_example", for the debug flavors: 4 MoE layers of 8 experts, top-2)
CHAT_EXAMPLE = os.path.join(os.path.dirname(__file__), "chat_example.jsonl")
ROLLOUTS_EXAMPLE = os.path.join(os.path.dirname(__file__), "rollouts_example.jsonl")
# the formats read from a local .jsonl file of records
RECORD_FORMATS = ("chat", "rollouts")
# local file suffix -> datasets' builder
_FILE_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this dp rank's micro-batches of global sequence indices, forever."""

    def __init__(self, dp_rank: int, dp_world_size: int, local_batch_size: int):
        self.dp_rank, self.dp_world_size, self.local_batch_size = dp_rank, dp_world_size, local_batch_size
        self.start = 0  # global sequences consumed before this iterator

    def __iter__(self):
        b, stride = self.local_batch_size, self.local_batch_size * self.dp_world_size
        first = self.start + self.dp_rank * b
        while True:
            yield list(range(first, first + b))
            first += stride


def collate(samples):
    """[({"input": [s], ...}, [s])] * b -> ({"input": [b, s], ...}, [b, s])"""
    return {k: torch.stack([x[k] for x, _ in samples]) for k in samples[0][0]}, torch.stack([y for _, y in samples])


class FoldDataLoader(ParallelAwareDataloader):
    """torchtitan's stateful dataloader over TokenWindows (or PackedDocuments) with the global-index sampler.

    state_dict holds only layout-free keys (the global count of sequences consumed, seq_len,
    the corpus fingerprint): unlike torchtitan's per-dp-rank keys, every rank of any new
    layout finds them in a DCP checkpoint, so the dp degree and local batch may change.
    """

    def __init__(
        self, dataset: TokenWindows | PackedDocuments, dp_rank: int, dp_world_size: int, local_batch_size: int, **kwargs
    ):
        self._batches = GlobalBatchSampler(dp_rank, dp_world_size, local_batch_size)
        self.consumed_sequences = 0
        super().__init__(dataset, dp_rank, dp_world_size, batch_sampler=self._batches, collate_fn=collate, **kwargs)

    def __iter__(self):
        self._batches.start = self.consumed_sequences
        step = self._batches.local_batch_size * self.dp_world_size
        for batch in super().__iter__():
            # counted before the caller sees the batch: a checkpoint taken now excludes it
            self.consumed_sequences += step
            yield batch

    def state_dict(self) -> dict:
        return {
            "consumed_sequences": self.consumed_sequences,
            "seq_len": self.dataset.seq_len,
            "dataset": self.dataset.fingerprint,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if "consumed_sequences" not in state_dict:
            raise ValueError(
                f"dataloader state has no 'consumed_sequences' (keys: {sorted(state_dict)}): not a titan_fold checkpoint"
            )
        if state_dict["seq_len"] != self.dataset.seq_len:
            raise ValueError(
                f"training.seq_len = {self.dataset.seq_len} but the checkpoint was taken with seq_len "
                f"{state_dict['seq_len']}: sequence indices would point elsewhere in the stream"
            )
        if state_dict["dataset"] != self.dataset.fingerprint:
            logger.warning(
                f"dataloader: checkpoint read {state_dict['dataset']}, now reading {self.dataset.fingerprint}"
            )
        self.consumed_sequences = int(state_dict["consumed_sequences"])


def load_hf_dataset(path: str):
    """A map-style `datasets.Dataset` (split "train") from a local file, folder or hub name
    that check_dataset has passed.

    Local files by suffix (.txt: one document per line; .json/.jsonl/.parquet/.csv: a "text"
    column); a folder written by save_to_disk or holding data files; else a hub name,
    "owner/name" or "owner/name:config". Streaming datasets are not supported (sequences are
    indexed into the whole tokenized stream).
    """
    import datasets

    if os.path.isfile(path):
        return datasets.load_dataset(_FILE_BUILDERS[os.path.splitext(path)[1].lower()], data_files=path, split="train")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(
            os.path.join(path, "dataset_dict.json")
        ):
            ds = datasets.load_from_disk(path)
            return ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(path, split="train")
    name, _, config = path.partition(":")
    return datasets.load_dataset(name, config or None, split="train")


# a text column's feature dtypes: strings, or bytes (decoded as UTF-8)
_TEXT_DTYPES = ("string", "large_string", "binary", "large_binary")


def open_text_dataset(path: str, column: str = "text"):
    """load_hf_dataset, and its `column` holding a string (or nothing) in every record; a
    dataset that cannot give text is one DataError line naming the path and the cause."""
    import datasets

    try:
        ds = load_hf_dataset(path)
    except (datasets.exceptions.DatasetsError, OSError, ValueError) as e:
        # datasets wraps a parse error of the file's builder in DatasetGenerationError
        cause = e.__cause__ if isinstance(e, datasets.exceptions.DatasetGenerationError) and e.__cause__ else e
        where = "cannot be read" if os.path.exists(path) else "no such local file or folder, nor a readable Hub dataset"
        detail = " ".join(f"{type(cause).__name__}: {cause}".split())
        raise DataError(f"training.dataset_path = '{path}': {where} ({detail})") from None
    if column not in ds.column_names:
        raise DataError(f"training.dataset_path = '{path}' has no '{column}' column (columns: {ds.column_names})")
    feature = ds.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in _TEXT_DTYPES):
        batch = 1024
        for b, rows in enumerate(ds.select_columns([column]).iter(batch_size=batch)):
            for i, value in enumerate(rows[column]):
                if not isinstance(value, (str, bytes, type(None))):
                    raise DataError(
                        f"training.dataset_path = '{path}': record {b * batch + i} has a '{column}' of "
                        f"type {type(value).__name__} ({str(value)[:40]!r}), not a string"
                    )
    return ds


def training_settings(job_config) -> Training:
    """job_config.training with titan_fold's defaults for the keys a torchtitan config lacks
    (bench/vs_torchtitan.py plugs this dataloader into torchtitan's own trainer and config)."""
    tr = job_config.training
    if isinstance(tr, Training):
        return tr
    return Training(**{f.name: getattr(tr, f.name) for f in fields(Training) if hasattr(tr, f.name)})


def _check_dataset_settings(tr) -> bool:
    """What can be known without reading the dataset: the name, the path's use, and a local
    path that exists, is readable and is not empty; -> whether the path is local."""
    if tr.dataset not in DATASETS:
        raise DataError(f"training.dataset = '{tr.dataset}' is unknown; valid names: {list(DATASETS)}")
    embedded = {"stdlib": "text", "chat_example": "chat", "rollouts_example": "rollouts"}
    if tr.dataset in embedded:
        if tr.dataset_format != embedded[tr.dataset]:
            raise DataError(
                f"training.dataset = '{tr.dataset}' holds {embedded[tr.dataset]} data; set "
                f"training.dataset_format = '{embedded[tr.dataset]}' (or training.dataset = 'hf' with a path)"
            )
        if tr.dataset_path:
            raise DataError(
                f"training.dataset_path = '{tr.dataset_path}' is set but training.dataset = '{tr.dataset}' reads "
                "embedded data; use training.dataset = 'hf' to read the path"
            )
        return False
    path = tr.dataset_path
    if not path:
        raise DataError("training.dataset = 'hf' needs training.dataset_path (a local file, folder or HF hub name)")
    if tr.dataset_format in RECORD_FORMATS and not (os.path.isfile(path) and path.lower().endswith(".jsonl")):
        raise DataError(
            f"training.dataset_format = '{tr.dataset_format}': training.dataset_path = '{path}' must be a local .jsonl file"
        )
    if os.path.isfile(path):
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in _FILE_BUILDERS:
            raise DataError(
                f"training.dataset_path = '{path}': unsupported file type '{suffix}' (supported: {sorted(_FILE_BUILDERS)})"
            )
        if not os.access(path, os.R_OK):
            raise DataError(f"training.dataset_path = '{path}': not readable (permission denied)")
        if os.path.getsize(path) == 0:
            raise DataError(f"training.dataset_path = '{path}': the file is empty")
        return True
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise DataError(f"training.dataset_path = '{path}': the folder is not readable (permission denied)")
        if not any(os.scandir(path)):
            raise DataError(f"training.dataset_path = '{path}': the folder is empty")
        return True
    if path.startswith(("/", ".", "~")) or os.path.splitext(path)[1].lower() in _FILE_BUILDERS:
        raise DataError(f"training.dataset_path = '{path}' does not exist")
    return False


def _chat_path(tr) -> str:
    return CHAT_EXAMPLE if tr.dataset == "chat_example" else tr.dataset_path


def _rollouts_path(tr) -> str:
    return ROLLOUTS_EXAMPLE if tr.dataset == "rollouts_example" else tr.dataset_path


def check_dataset(job_config, tokenizer=None, model_args=None) -> str | None:
    """The dataset settings, and a local dataset opened with text in every record (chat: every
    record checked, and the tokenizer's chat template found; rollouts: every record checked
    against model_args); -> a Hub name, which build_dataset alone reads (a dry run's machine
    may not reach the Hub)."""
    tr = training_settings(job_config)
    local = _check_dataset_settings(tr)
    if tr.dataset_format == "rollouts":
        if model_args is not None:
            documents = read_rollouts(_rollouts_path(tr), RoutingShape.of(model_args))
            if model_args.moe.routing_replay == "rollout" and documents[0].routed_experts is None:
                raise DataError(
                    f"moe.routing_replay = 'rollout' with training.dataset_path = '{_rollouts_path(tr)}': its "
                    "records carry no routed_experts to replay; add them, or set moe.routing_replay = 'recorded' or 'off'"
                )
        return None
    if tr.dataset_format == "chat":
        read_conversations(_chat_path(tr))
        if tokenizer is not None:
            chat_template(tokenizer, job_config.model.hf_assets_path)
        return None
    if local:
        open_text_dataset(tr.dataset_path)
        return None
    return tr.dataset_path if tr.dataset == "hf" else None


def build_chat_dataset(tokenizer, job_config) -> PackedDocuments:
    """Every conversation rendered, tokenized and packed (packing.py) before training starts."""
    tr = training_settings(job_config)
    path = _chat_path(tr)
    template, encode = chat_template(tokenizer, job_config.model.hf_assets_path), text_encoder(tokenizer)
    documents = []
    for i, messages in enumerate(read_conversations(path)):
        try:
            documents.append(tokenize_conversation(template, encode, messages))
        except DataError as e:
            raise DataError(f"training.dataset_path = '{path}': record {i}: {e}") from None
    name = "chat_example" if tr.dataset == "chat_example" else f"training.dataset_path = '{path}'"
    packed = PackedDocuments(documents, tr.seq_len, tr.long_documents, name, documents_masked(tr))
    if not packed.trained_tokens:
        raise DataError(f"{name}: no assistant token within the first training.seq_len = {tr.seq_len} of any record")
    cut = f"; {packed.truncated} longer than seq_len {tr.seq_len} cut to it" if packed.truncated else ""
    logger.info(
        f"dataset {path}: {len(documents):,} conversations in {len(packed.packs):,} samples of {tr.seq_len} "
        f"tokens, {packed.trained_tokens:,} trained (assistant) tokens per epoch{cut}"
    )
    return packed


def build_rollouts_dataset(job_config, model_args) -> PackedDocuments:
    """Every rollout record checked against the model and packed (packing.py) before training
    starts, with its per-token fields (rollouts.py)."""
    tr = training_settings(job_config)
    path, shape = _rollouts_path(tr), RoutingShape.of(model_args)
    documents = read_rollouts(path, shape)
    name = "rollouts_example" if tr.dataset == "rollouts_example" else f"training.dataset_path = '{path}'"
    token_fields, fields = rollout_fields(documents, shape)
    packed = PackedDocuments(
        [(d.ids, d.trained) for d in documents],
        tr.seq_len,
        tr.long_documents,
        name,
        documents_masked(tr),
        token_fields=token_fields,
        fields=fields,
    )
    if not packed.trained_tokens:
        raise DataError(f"{name}: no loss_mask token within the first training.seq_len = {tr.seq_len} of any record")
    cut = f"; {packed.truncated} longer than seq_len {tr.seq_len} cut to it" if packed.truncated else ""
    routed = ", with routed_experts" if documents[0].routed_experts is not None else ""
    logger.info(
        f"dataset {path}: {len(documents):,} rollouts{routed} in {len(packed.packs):,} samples of {tr.seq_len} "
        f"tokens, {packed.trained_tokens:,} trained (loss_mask) tokens per epoch{cut}"
    )
    return packed


def build_dataset(tokenizer, job_config, model_args=None) -> TokenWindows | PackedDocuments:
    tr = training_settings(job_config)
    _check_dataset_settings(tr)
    if tr.dataset_format == "rollouts":
        if model_args is None:
            raise ValueError("training.dataset_format = 'rollouts' is checked against the model: pass model_args")
        return build_rollouts_dataset(job_config, model_args)
    if tr.dataset_format == "chat":
        return build_chat_dataset(tokenizer, job_config)
    corpus: StdlibCorpus | HFTextCorpus
    if tr.dataset == "stdlib":
        corpus = StdlibCorpus(tokenizer)
    else:
        corpus = HFTextCorpus(open_text_dataset(tr.dataset_path), tokenizer, fingerprint=f"hf:{tr.dataset_path}")
    windows = TokenWindows(corpus, tr.seq_len, document_masking=documents_masked(tr))
    epoch = f"{windows.total_tokens:,} tokens per epoch" if windows.total_tokens else "epoch length found while reading"
    name = "stdlib (the Python standard library's sources)" if tr.dataset == "stdlib" else tr.dataset_path
    logger.info(f"dataset {name}: {len(corpus):,} documents, {epoch}")
    return windows


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, model_args=None) -> FoldDataLoader:
    """torchtitan TrainSpec.build_dataloader_fn: yields ({"input": [b, s]}, labels [b, s]), with
    document masking also "document_ids": [b, s]; rollouts (checked against model_args) also
    "behaviour_logprobs", "advantages" [b, s] float32 (of each label's token) and, where the
    records have them, "routed_experts" [b, s, moe_layers, top_k] int64 (of each input token)."""
    tr = training_settings(job_config)
    b = tr.local_batch_size
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} outside dp degree {dp_world_size}")
    if b < 1 or tr.seq_len < 1:
        raise ValueError(f"training.local_batch_size = {b} and training.seq_len = {tr.seq_len} must be >= 1")
    global_batch = tr.global_batch_size if tr.global_batch_size > 0 else b * dp_world_size
    if global_batch % (b * dp_world_size):
        raise ValueError(
            f"training.global_batch_size = {global_batch} must be a multiple of training.local_batch_size x "
            f"dp degree = {b} x {dp_world_size}"
        )
    dataset = build_dataset(tokenizer, job_config, model_args)
    return FoldDataLoader(dataset, dp_rank, dp_world_size, b, **asdict(tr.dataloader))
