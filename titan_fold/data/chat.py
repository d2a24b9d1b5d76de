"""Chat SFT data (training.dataset_format = "chat"): conversations in jsonl, rendered with the
model's chat template, tokenized with a loss mask on the assistant turns only.

A record is one line `{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}`.
The template is the Jinja text of the HF tokenizer folder's tokenizer_config.json
("chat_template"; or chat_template.jinja), rendered in a sandbox with the variables
transformers' apply_chat_template gives it (messages, add_generation_prompt, bos_token,
eos_token). The byte-level tokenizer has no folder: it renders BYTE_TEMPLATE (ChatML).

The loss mask comes from rendering prefixes: the text up to each assistant turn with the
generation prompt, then with that turn. What the turn adds (its content and end-of-turn
marker) is trained on; the rest (system, user turns, role headers) is not. A template that
renders the last turn otherwise (Qwen3's empty thinking block) is followed in the full text
through the turn's content and the end marker after it. Each piece is
tokenized on its own, without added special tokens, as apply_chat_template tokenizes the text.
"""

import json
import os
from collections.abc import Callable

import numpy as np

from titan_fold.data.dataset import DataError
from titan_fold.data.tokenizer import ByteTokenizer

ROLES = ("system", "user", "assistant")

# ChatML, for the byte-level tokenizer (its bytes carry the markers)
BYTE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _special(config: dict, key: str) -> str:
    value = config.get(key) or ""
    return value.get("content", "") if isinstance(value, dict) else value


def template_source(folder: str) -> tuple[str, dict[str, str]]:
    """The chat template of the HF tokenizer folder and the special tokens it names; a folder
    without one is a DataError naming the folder."""
    path = os.path.join(folder, "tokenizer_config.json")
    config = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = os.path.join(folder, "chat_template.jinja")
    if not template and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if not template:
        raise DataError(
            f"training.dataset_format = 'chat': model.hf_assets_path = '{folder}' has no chat template "
            "(no 'chat_template' in tokenizer_config.json, no chat_template.jinja)"
        )
    return template, {"bos_token": _special(config, "bos_token"), "eos_token": _special(config, "eos_token")}


class ChatTemplate:
    """A Jinja chat template, compiled once in a sandbox (templates from the Hub are untrusted)."""

    def __init__(self, template: str, special_tokens: dict[str, str]):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise DataError(f"the chat template refuses the conversation: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(template)
        self.special_tokens = special_tokens

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )


def chat_template(tokenizer, folder: str) -> ChatTemplate:
    if isinstance(tokenizer, ByteTokenizer):
        return ChatTemplate(BYTE_TEMPLATE, {"bos_token": "", "eos_token": ""})
    return ChatTemplate(*template_source(folder))


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """Text -> ids with no BOS/EOS added: the template writes the special tokens it wants."""
    if isinstance(tokenizer, ByteTokenizer):
        return lambda text: tokenizer.encode(text)
    return lambda text: tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def _assistant_end(full: str, prefix: str, alone: str, content: str) -> int | None:
    """Where an assistant turn ends in the full rendering `full`, which holds `prefix` (the text
    before the turn) first: where `alone` (the conversation rendered up to this turn) ends when
    full holds it, else after the turn's content and the end marker `alone` writes after it
    (templates that render the last turn otherwise, as Qwen3's empty thinking block)."""
    if full.startswith(alone):
        return len(alone)
    at, end = alone.rfind(content), full.find(content, len(prefix))
    if at < len(prefix) or end < 0:
        return None
    marker = alone[at + len(content) :]
    end += len(content)
    return end + len(marker) if full.startswith(marker, end) else None


def render_pieces(template: ChatTemplate, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces: trained = an assistant turn's own text."""
    full = template.render(messages)
    pieces, done = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = template.render(messages[:i], add_generation_prompt=True)
        end = None
        if full.startswith(prefix) and len(prefix) >= done:
            end = _assistant_end(full, prefix, template.render(messages[: i + 1]), message["content"])
        if end is None:
            raise DataError(
                f"the chat template renders the text before message {i} (assistant) otherwise once later "
                "turns follow: its tokens cannot be found for the loss mask"
            )
        pieces += [(full[done : len(prefix)], False), (full[len(prefix) : end], True)]
        done = end
    pieces.append((full[done:], False))
    return [(text, trained) for text, trained in pieces if text]


def tokenize_conversation(template: ChatTemplate, encode, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """ids [n] int64 and trained [n] bool (the assistant turns' tokens) of one conversation."""
    ids, trained = [], []
    for text, train in render_pieces(template, messages):
        piece = encode(text)
        ids.extend(piece)
        trained.extend([train] * len(piece))
    return np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool)


def check_record(record, where: str) -> list[dict]:
    """The messages of one parsed jsonl record; anything else is a DataError naming `where`."""
    if not isinstance(record, dict) or "messages" not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: no 'messages' (found {keys})")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise DataError(f"{where}: message {j} must be {{'role': ..., 'content': a string}}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {j} has unknown role {m['role']!r} (roles: {list(ROLES)})")
        if m["role"] == "assistant" and not m["content"].strip():
            # it would teach the model to answer with its end-of-turn marker alone
            raise DataError(f"{where}: message {j} (assistant) is empty, nothing to train on")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message, nothing to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_conversations(path: str) -> list[list[dict]]:
    """Every record of the jsonl file at path, checked (check_record); records count from 0."""
    conversations: list[list[dict]] = []
    with open(path, "rb") as f:  # decoded line by line: a bad byte is named by its line
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"training.dataset_path = '{path}': record {len(conversations)} (line {line_number})"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg})") from None
            conversations.append(check_record(record, where))
    if not conversations:
        raise DataError(f"training.dataset_path = '{path}': no records")
    return conversations
