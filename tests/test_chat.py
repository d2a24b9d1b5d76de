"""Chat SFT data (training.dataset_format = "chat"): the rendering against transformers'
apply_chat_template on a tokenizer folder built here, labels on the assistant turns only and
within one document, packing, the masked tokens' zero gradient, and bad data refused in one
line naming the file and the record."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import torchrun, train_from_seed
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torchtitan.protocols.train_spec import get_train_spec

from titan_fold.common.config import ConfigError, parse_args
from titan_fold.data.chat import chat_template, text_encoder, tokenize_conversation
from titan_fold.data.dataloader import CHAT_EXAMPLE, build_dataset, check_dataset
from titan_fold.data.dataset import DataError
from titan_fold.data.tokenizer import ByteTokenizer, build_tokenizer
from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.mtp import IGNORE_INDEX
from titan_fold.trainer.train_spec import register_train_specs

# a ChatML template with a default system turn, as Qwen's (written for this test)
TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "What is 7 times 8?"},
    {"role": "assistant", "content": "56."},
    {"role": "user", "content": "And 56 minus 6?"},
    {"role": "assistant", "content": "It is 50."},
]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny BPE tokenizer.json trained on the example conversations, with the ChatML markers
    as special tokens, and a tokenizer_config.json with TEMPLATE."""
    folder = tmp_path_factory.mktemp("tok")
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(CHAT_EXAMPLE) as f:
        texts = [m["content"] for line in f for m in json.loads(line)["messages"]]
    # every byte in the alphabet: decoding is lossless
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def job(tmp_path, *overrides, folder=""):
    return parse_args(
        [
            "--job.config_file",
            "debug_sft.toml",
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--model.hf_assets_path",
            str(folder),
            *overrides,
        ]
    )


# as TEMPLATE, but the assistant turns after the last user turn open with an empty thinking
# block (Qwen3's rule): a conversation's beginning renders otherwise once later turns follow
THINK_TEMPLATE = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("template", ["chatml", "think"])
def test_rendering_matches_transformers(hf_folder, tmp_path, template):
    folder = hf_folder
    if template == "think":
        folder = tmp_path / "think"
        folder.mkdir()
        (folder / "tokenizer.json").write_text((hf_folder / "tokenizer.json").read_text())
        config = json.loads((hf_folder / "tokenizer_config.json").read_text()) | {"chat_template": THINK_TEMPLATE}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    config = parse_args(["--job.config_file", "debug_sft.toml", "--model.hf_assets_path", str(folder)])
    tokenizer = build_tokenizer(config)
    template = chat_template(tokenizer, str(folder))
    for messages in (CONVERSATION, [{"role": "system", "content": "Hi."}, *CONVERSATION[:2]]):
        text = reference.apply_chat_template(messages, tokenize=False)
        assert template.render(messages) == text
        ids, trained = tokenize_conversation(template, text_encoder(tokenizer), messages)
        want = reference.apply_chat_template(messages, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert ids.tolist() == list(want)
        # trained: exactly each assistant turn's text after its header, through its end marker
        spans, run = [], []
        for i, t in zip(ids.tolist(), trained.tolist(), strict=True):
            if t:
                run.append(i)
            elif run:
                spans.append(reference.decode(run))
                run = []
        spans += [reference.decode(run)] if run else []
        answers = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        if "<think>" in text:  # the last answer's thinking block is the model's to write
            answers[-1] = "<think>\n\n</think>\n\n" + answers[-1]
        assert spans == answers


def test_packed_labels_only_on_assistant_tokens_within_a_document(tmp_path):
    ds = build_dataset(ByteTokenizer(), job(tmp_path))
    with open(CHAT_EXAMPLE) as f:
        conversations = [json.loads(line)["messages"] for line in f]
    answers = [m["content"] + "<|im_end|>\n" for c in conversations for m in c if m["role"] == "assistant"]
    got, samples = [], {len(pack) for pack in ds.packs}
    assert max(samples) > 1, "packing put one conversation per sample"
    for g in range(len(ds.packs)):
        x, labels = ds[g]
        ids, docs = x["input"], x["document_ids"]
        # a label is the next token of the same document
        keep = labels != IGNORE_INDEX
        assert torch.equal(labels[keep], ids[1:][keep[:-1]]) and not keep[-1]
        assert (docs[:-1][keep[:-1]] == docs[1:][keep[:-1]]).all()
        run = []
        for i, k in enumerate(keep.tolist()):
            if k:
                run.append(int(labels[i]))
            elif run:
                got.append(bytes(run).decode())
                run = []
    # the first token of each answer follows the header: trained too (the label of the header's last token)
    assert got == answers
    # epochs repeat: sample len(packs) is sample 0
    assert torch.equal(ds[len(ds.packs)][1], ds[0][1])


def test_masked_tokens_give_exactly_zero_gradient(tmp_path):
    """Through the trainer's loss (its train spec's loss_fn), on a packed sample of the data."""
    config = job(tmp_path)
    ds = build_dataset(ByteTokenizer(), config)
    register_train_specs()
    loss_fn = get_train_spec("qwen3_moe").build_loss_fn(config)
    x, labels = ds[0]
    args = FLAVORS["qwen3_moe"]["debug"]
    args = dataclasses.replace(args, n_layers=1, moe=dataclasses.replace(args.moe, load_balance="none"))
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    # targets at masked positions changed to random tokens: the gradients stay bit-identical
    masked = labels == IGNORE_INDEX
    assert masked.any() and not masked.all()
    grads = []
    for loss in ("trainer", "reference"):
        model.zero_grad()
        logits = model(x["input"][None], document_ids=x["document_ids"][None])
        logits.retain_grad()
        if loss == "trainer":
            loss_fn(logits, labels[None]).backward()
            # the masked tokens' logits get exactly nothing, every trained token's get something
            assert logits.grad[0][masked].abs().max() == 0
            assert logits.grad[0][~masked].abs().amax(-1).min() > 0
        else:  # the trained tokens' logits alone: the masked ones never enter the loss
            F.cross_entropy(logits[0][~masked], labels[~masked], reduction="sum").backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"text": "x"}, r"record 1 \(line 2\): no 'messages' \(found \['text'\]\)"),
        (
            {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
            r"record 1 \(line 2\): message 0 has unknown role 'robot'",
        ),
        ("{not json", r"record 1 \(line 2\): not JSON"),
        ({"messages": [{"role": "user", "content": "x"}]}, r"record 1 \(line 2\): no assistant message"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " \n"}]},
            r"record 1 \(line 2\): message 1 \(assistant\) is empty, nothing to train on",
        ),
    ],
)
def test_bad_records_refused_naming_file_and_record(tmp_path, bad, message):
    path = write(tmp_path / "chat.jsonl", [GOOD, bad])
    config = job(tmp_path, "--training.dataset", "hf", "--training.dataset_path", str(path))
    with pytest.raises(DataError, match=f"^training.dataset_path = '{path}': {message}"):
        check_dataset(config)


def test_invalid_utf8_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "ok"}]}\n'
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\n" + bad)
    config = job(tmp_path, "--training.dataset", "hf", "--training.dataset_path", str(path))
    with pytest.raises(
        DataError,
        match=rf"^training.dataset_path = '{path}': record 1 \(line 3\): not UTF-8 \(byte 0xe9 at column 47\)$",
    ):
        check_dataset(config)


def test_template_missing_refused(tmp_path, hf_folder):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((hf_folder / "tokenizer.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    config = job(tmp_path, folder=folder)
    with pytest.raises(DataError, match=f"model.hf_assets_path = '{folder}' has no chat template"):
        check_dataset(config, build_tokenizer(config))


def test_long_documents_truncated_or_refused(tmp_path):
    long = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 300}]}
    path = write(tmp_path / "chat.jsonl", [GOOD, long, GOOD])
    args = ["--training.dataset", "hf", "--training.dataset_path", str(path), "--training.seq_len", "96"]
    ds = build_dataset(ByteTokenizer(), job(tmp_path, *args))
    assert ds.truncated == 1 and len(ds.documents[1][0]) == 96
    with pytest.raises(DataError, match=rf"'{path}': record 1 is \d+ tokens, longer than training.seq_len = 96"):
        build_dataset(ByteTokenizer(), job(tmp_path, *args, "--training.long_documents", "refuse"))


def test_step_loss_is_a_token_mean_and_matches_one_rank(tmp_path):
    """One step of debug_sft from one seed checkpoint on 1 rank (one micro-batch of 8 samples),
    on dp 2 (2 micro-batches of 2 each) and on pp 2 (1F1B). The samples hold different numbers
    of assistant tokens, so a mean per micro-batch or per rank would give another loss than the
    trainer's sum over the global token count. Under pp the last stage masks attention by
    document too: the loss and gradient norm without document masking are farther off than the
    tolerance."""
    ds = build_dataset(ByteTokenizer(), job(tmp_path))
    counts = [int((ds[g][1] != IGNORE_INDEX).sum()) for g in range(8)]
    assert len({sum(counts[i : i + 2]) for i in range(0, 8, 2)}) > 1, counts
    # the same initial weights in every layout: a seed checkpoint (FSDP's init draws other numbers)
    torchrun(
        1,
        "--job.dump_folder",
        str(tmp_path / "seed"),
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        config="debug_sft.toml",
    )
    # no aux or z loss: they are means over each micro-batch, which pp splits further
    plain = ["--moe.load_balance", "none", "--moe.aux_loss_coeff", "0", "--moe.z_loss_coeff", "0"]
    pp2 = [*plain, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"]
    pp2 += ["--parallelism.pipeline_parallel_schedule", "1F1B"]
    runs = {
        "one": (1, [*plain, "--training.local_batch_size", "8"]),
        "dp2": (2, [*plain, "--training.local_batch_size", "2"]),
        "pp2": (2, pp2),
        "pp2_unmasked": (2, [*pp2, "--training.document_masking", "False"]),
    }
    got = {}
    for name, (ranks, args) in runs.items():
        seed = str(tmp_path / "seed" / "checkpoint" / "step-0")
        metrics = train_from_seed(tmp_path / name, ranks, seed, 1, *args, config="debug_sft.toml")
        got[name] = metrics[0]["loss"], metrics[0]["grad_norm"]
    for name in ("dp2", "pp2"):
        assert got[name] == pytest.approx(got["one"], rel=2e-6, abs=0), got
    assert got["pp2_unmasked"] != pytest.approx(got["one"], rel=2e-5, abs=0), got


@pytest.mark.parametrize(
    "key, value",
    [
        ("--mtp.num_layers", "1"),
        ("--moe.ep_overlap", "batch"),
    ],
)
def test_what_packed_documents_do_not_take_is_refused(tmp_path, key, value):
    with pytest.raises(
        ConfigError, match=f"training.document_masking with {key[2:]} = .*set training.document_masking = false"
    ):
        job(tmp_path, key, *([value] if value else []))
