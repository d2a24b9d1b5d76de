"""Rollout data (training.dataset_format = "rollouts"): sampled sequences in jsonl, one record
each, with what the policy objective needs per token (docs/rl.md, "Rollout data").

A record is one line with exactly these keys (n = its number of tokens):

    tokens          [n] int             prompt + response ids
    loss_mask       [n] 0/1             1 on the response tokens (the loss's)
    advantages      float | [n] float   one per sequence, or one per token
    logprobs        [n] float           the behaviour policy's log-probability of each token
    routed_experts  optional: [n][L][k] int, or a string: base64 of little-endian int16 in
                    that layout (n * L * k values), the top-k expert ids of each token in each
                    of the model's L MoE layers (model order; dense layers have none)

Every record is checked before training starts, against the model (vocabulary, experts,
top-k, MoE layers): a malformed one is a DataError naming the file, the record and what is
wrong, and nothing is trained. A checked record becomes a RolloutDocument, which packing.py
packs as it packs chat conversations.
"""

import base64
import binascii
import dataclasses
import json
import math

import numpy as np
import torch

from titan_fold.data.dataset import DataError
from titan_fold.data.packing import TokenField

KEYS = ("tokens", "loss_mask", "advantages", "logprobs")
OPTIONAL_KEYS = ("routed_experts",)


@dataclasses.dataclass(frozen=True)
class RoutingShape:
    """What a record is checked against: the model's vocabulary and, for routed_experts, its
    experts, top-k and number of MoE layers."""

    vocab_size: int
    num_experts: int
    top_k: int
    moe_layers: int

    @classmethod
    def of(cls, model_args) -> "RoutingShape":
        layers = sum(model_args.is_moe_layer(i) for i in range(model_args.n_layers))
        return cls(model_args.vocab_size, model_args.moe.num_experts, model_args.moe.top_k, layers)


@dataclasses.dataclass
class RolloutDocument:
    """One checked record: ids [n] int64, trained [n] bool (loss_mask), logprobs and advantages
    [n] float32 (token i's), routed_experts [n, L, k] int64 or None."""

    ids: np.ndarray
    trained: np.ndarray
    logprobs: np.ndarray
    advantages: np.ndarray
    routed_experts: np.ndarray | None


def encode_routed_experts(routed: np.ndarray) -> str:
    """[n, L, k] expert ids -> the compact form: base64 of little-endian int16."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype="<i2").tobytes()).decode("ascii")


def _numbers(value, key: str, n: int | None) -> np.ndarray:
    """A list of finite numbers (of length n when given) as float64; else DataError's message."""
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise DataError(f"'{key}' must be a list of numbers")
    if n is not None and len(value) != n:
        raise DataError(f"'{key}' has {len(value)} values but 'tokens' has {n}: the lengths disagree")
    array = np.asarray(value, dtype=np.float64)
    if not np.isfinite(array).all():
        raise DataError(f"'{key}' holds a non-finite value at token {int(np.argmin(np.isfinite(array)))}")
    return array


def _integers(value, key: str) -> np.ndarray:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise DataError(f"'{key}' must be a list of integers")
    return np.asarray(value, dtype=np.int64)


def _routed_experts(value, n: int, shape: RoutingShape) -> np.ndarray:
    """[n, L, k] int64 from the list or the base64 form, checked: layers, k, range, no repeats."""
    layers, k = shape.moe_layers, shape.top_k
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise DataError("'routed_experts' is a string but not base64") from None
        if len(raw) % 2:
            raise DataError(f"'routed_experts' decodes to {len(raw)} bytes, not a whole number of int16 values")
        flat = np.frombuffer(raw, dtype="<i2").astype(np.int64)
        if flat.size != n * layers * k:
            per_token = flat.size / n
            found = f"{per_token:g} ids per token" + (
                f" ({per_token / k:g} MoE layers of top_k {k})" if per_token % k == 0 else ""
            )
            raise DataError(
                f"'routed_experts' (base64 int16) holds {flat.size} ids: {found}, but the model has "
                f"{layers} MoE layers x top_k {k} = {layers * k} per token for {n} tokens"
            )
        routed = flat.reshape(n, layers, k)
    else:
        if not isinstance(value, list) or len(value) != n:
            got = f"{len(value)} tokens" if isinstance(value, list) else type(value).__name__
            raise DataError(f"'routed_experts' has {got} but 'tokens' has {n}: the lengths disagree")
        for t, token in enumerate(value):
            if not isinstance(token, list) or len(token) != layers:
                layers_got = len(token) if isinstance(token, list) else type(token).__name__
                raise DataError(
                    f"'routed_experts' of token {t} has {layers_got} MoE layers, the model has {layers} "
                    "(dense layers have none)"
                )
            for layer, ids in enumerate(token):
                if not isinstance(ids, list) or len(ids) != k:
                    ids_got = len(ids) if isinstance(ids, list) else type(ids).__name__
                    raise DataError(
                        f"'routed_experts' of token {t}, MoE layer {layer} has {ids_got} ids, the model's top_k is {k}"
                    )
                if any(isinstance(e, bool) or not isinstance(e, int) for e in ids):
                    raise DataError(f"'routed_experts' of token {t}, MoE layer {layer} holds a non-integer id")
        routed = np.asarray(value, dtype=np.int64).reshape(n, layers, k)
    bad = (routed < 0) | (routed >= shape.num_experts)
    if bad.any():
        t, layer, j = (int(i) for i in np.argwhere(bad)[0])
        raise DataError(
            f"'routed_experts' of token {t}, MoE layer {layer}: expert {int(routed[t, layer, j])} is out of "
            f"range (the model has experts 0..{shape.num_experts - 1})"
        )
    ordered = np.sort(routed, axis=-1)
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1)  # [n, L]
    if repeated.any():
        t, layer = (int(i) for i in np.argwhere(repeated)[0])
        raise DataError(
            f"'routed_experts' of token {t}, MoE layer {layer} repeats an expert: {routed[t, layer].tolist()}"
        )
    return routed


def check_rollout(record, shape: RoutingShape) -> RolloutDocument:
    """One parsed jsonl record, checked; anything else is a DataError saying what is wrong."""
    if not isinstance(record, dict):
        raise DataError(f"not a JSON object but {type(record).__name__}")
    if unknown := sorted(set(record) - set(KEYS) - set(OPTIONAL_KEYS)):
        raise DataError(f"unknown keys {unknown} (a record has {list(KEYS)} and optionally {list(OPTIONAL_KEYS)})")
    if missing := [k for k in KEYS if k not in record]:
        raise DataError(f"no {missing} (a record has {list(KEYS)} and optionally {list(OPTIONAL_KEYS)})")
    ids = _integers(record["tokens"], "tokens")
    n = len(ids)
    if n < 2:
        raise DataError(f"'tokens' has {n} tokens: nothing to predict")
    if (out := (ids < 0) | (ids >= shape.vocab_size)).any():
        t = int(np.argmax(out))
        raise DataError(f"token {t} is id {int(ids[t])}, outside the model's vocabulary 0..{shape.vocab_size - 1}")
    mask = _integers(record["loss_mask"], "loss_mask")
    if len(mask) != n:
        raise DataError(f"'loss_mask' has {len(mask)} values but 'tokens' has {n}: the lengths disagree")
    if not np.isin(mask, (0, 1)).all():
        raise DataError("'loss_mask' must hold 0 and 1 only")
    if mask[0]:
        raise DataError("'loss_mask' is 1 on token 0, which no earlier token predicts")
    if not mask.any():
        raise DataError("'loss_mask' is 0 on every token, nothing to train on")
    logprobs = _numbers(record["logprobs"], "logprobs", n)
    if (logprobs > 0).any():
        t = int(np.argmax(logprobs > 0))
        raise DataError(f"'logprobs' of token {t} is {logprobs[t]}, above 0: not a log-probability")
    advantages = record["advantages"]
    if isinstance(advantages, (int, float)) and not isinstance(advantages, bool):
        if not math.isfinite(advantages):
            raise DataError(f"'advantages' is {advantages}, not a finite number")
        per_token = np.full(n, float(advantages))
    else:
        per_token = _numbers(advantages, "advantages", n)
    routed = record.get("routed_experts")
    return RolloutDocument(
        ids=ids,
        trained=mask.astype(bool),
        logprobs=logprobs.astype(np.float32),
        advantages=per_token.astype(np.float32),
        routed_experts=None if routed is None else _routed_experts(routed, n, shape),
    )


def read_rollouts(path: str, shape: RoutingShape) -> list[RolloutDocument]:
    """Every record of the jsonl file at path, checked (check_rollout); records count from 0.
    Either every record has routed_experts or none has."""
    documents: list[RolloutDocument] = []
    with open(path, "rb") as f:  # decoded line by line: a bad byte is named by its line
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"training.dataset_path = '{path}': record {len(documents)} (line {line_number})"
            try:
                record = json.loads(raw.decode("utf-8"))
                documents.append(check_rollout(record, shape))
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg})") from None
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
            if (documents[-1].routed_experts is None) != (documents[0].routed_experts is None):
                first = "has" if documents[0].routed_experts is not None else "has no"
                raise DataError(
                    f"{where}: {'no ' if documents[-1].routed_experts is None else ''}'routed_experts', but record 0 "
                    f"{first} 'routed_experts': either every record has them or none"
                )
    if not documents:
        raise DataError(f"training.dataset_path = '{path}': no records")
    return documents


# the batch's keys for the per-token fields ({"input": [b, s], ...}): the behaviour
# log-probability and advantage of each label's token, and each input token's routing
LOGPROBS_KEY, ADVANTAGES_KEY, ROUTED_EXPERTS_KEY = "behaviour_logprobs", "advantages", "routed_experts"


def rollout_fields(documents: list[RolloutDocument], shape: RoutingShape) -> tuple[tuple[TokenField, ...], list[dict]]:
    """The token fields (packing.TokenField) of the documents and their arrays, for PackedDocuments:
    padding has log-probability and advantage 0 and routed_experts -1 (no replayed routing: the
    router's own choice)."""
    fields = [
        TokenField(LOGPROBS_KEY, 1, np.zeros((), np.float32)),
        TokenField(ADVANTAGES_KEY, 1, np.zeros((), np.float32)),
    ]
    if documents[0].routed_experts is not None:
        pad = np.full((shape.moe_layers, shape.top_k), -1, dtype=np.int64)
        fields.append(TokenField(ROUTED_EXPERTS_KEY, 0, pad))
    arrays = [
        {
            LOGPROBS_KEY: d.logprobs,
            ADVANTAGES_KEY: d.advantages,
            **({ROUTED_EXPERTS_KEY: d.routed_experts} if d.routed_experts is not None else {}),
        }
        for d in documents
    ]
    return tuple(fields), arrays


def stand_in_fields(b: int, s: int, shape: RoutingShape) -> dict[str, torch.Tensor]:
    """A batch's rollout fields [b, s, ...] for a step without data (the dry run's recorded step):
    log-probabilities 0, advantages 1, each token routed to experts 0..top_k-1."""
    routed = torch.arange(shape.top_k).expand(b, s, shape.moe_layers, shape.top_k).contiguous()
    return {
        LOGPROBS_KEY: torch.zeros(b, s),
        ADVANTAGES_KEY: torch.ones(b, s),
        ROUTED_EXPERTS_KEY: routed,
    }
