"""Data pipeline: byte tokenizer, stdlib corpus, layout invariance, resume across layouts, HF path."""

import json
import pathlib
import sysconfig
import time

import pytest
import torch

from titan_fold.common.config import JobConfig
from titan_fold.data import ByteTokenizer, build_dataloader, build_tokenizer

BOS, EOS = 256, 257


def job(dataset="stdlib", seq_len=16, local_batch_size=2, global_batch_size=-1, dataset_path=None, assets=None, **dl):
    jc = JobConfig()
    jc.training.dataset, jc.training.dataset_path = dataset, dataset_path
    jc.training.seq_len, jc.training.local_batch_size = seq_len, local_batch_size
    jc.training.global_batch_size = global_batch_size
    if assets is not None:
        jc.model.hf_assets_path = assets
    for k, v in dl.items():
        setattr(jc.training.dataloader, k, v)
    return jc


def loaders(jc, dp):
    tok = build_tokenizer(jc)
    return [build_dataloader(dp_world_size=dp, dp_rank=r, tokenizer=tok, job_config=jc) for r in range(dp)]


def steps(dls, accum, n_steps):
    """Per step, the sorted list of sequences (input + last label = the whole window) over all ranks."""
    its = [iter(dl) for dl in dls]
    out = []
    for _ in range(n_steps):
        rows = []
        for _ in range(accum):
            for it in its:
                x, y = next(it)
                assert torch.equal(x["input"][:, 1:], y[:, :-1])
                rows += [tuple(r) for r in torch.cat([x["input"], y[:, -1:]], 1).tolist()]
        out.append(sorted(rows))
    return out


def stdlib_reference_files() -> list[pathlib.Path]:
    """The stdlib files found another way: pathlib walk, own filters, sorted by posix path."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if any(d in skip or d.startswith((".", "config-")) for d in parts[:-1]) or p.name.startswith("_sysconfigdata"):
            continue
        if p.stat().st_size:
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def frame(byte_docs):
    return [t for d in byte_docs if d for t in (BOS, *d, EOS)]


def windows(stream, seq_len, first, count):
    n, L = seq_len + 1, len(stream)
    return [tuple(stream[(g * n + i) % L] for i in range(n)) for g in range(first, first + count)]


@pytest.fixture(scope="module")
def stdlib_ref():
    files = stdlib_reference_files()
    return frame([p.read_bytes() for p in files]), files


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ — tabs\tand\nnewlines"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == BOS and ids[-1] == EOS and ids[1:-1] == list(text.encode("utf-8"))
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == f"<s>{text}</s>"
    assert tok.get_vocab_size() == 258 and max(ids) < tok.get_vocab_size()
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # cut UTF-8 does not raise
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([258])
    assert isinstance(build_tokenizer(job()), ByteTokenizer)


def test_stdlib_matches_reference_and_is_fast(stdlib_ref):
    stream, files = stdlib_ref
    assert len(files) > 100
    t0 = time.perf_counter()
    (dl,) = loaders(job(seq_len=64, local_batch_size=4), 1)
    x, y = next(iter(dl))
    assert time.perf_counter() - t0 < 2.0
    assert x["input"].shape == y.shape == (4, 64) and x["input"].dtype == torch.int64
    assert dl.dataset.total_tokens == len(stream)
    got = [tuple(r) for r in torch.cat([x["input"], y[:, -1:]], 1).tolist()]
    assert got == windows(stream, 64, 0, 4)
    # deep inside the stream, and the window that wraps from the last file into the first
    ds = dl.dataset
    for g in (1000, len(stream) // 65, len(stream) // 65 + 1, 3 * len(stream) // 65 + 7):
        assert tuple(ds.window(g)[0].tolist()) == windows(stream, 64, g, 1)[0]
    # a second build (fresh caches, other access order) gives the same windows
    (dl2,) = loaders(job(seq_len=64, local_batch_size=4), 1)
    for g in (3 * len(stream) // 65 + 7, 5, 1000):
        assert torch.equal(dl2.dataset.window(g)[0], ds.window(g)[0])


# (dp degree D, local batch b, accumulation A) with D * b * A = 12
LAYOUTS = [(1, 12, 1), (1, 4, 3), (2, 6, 1), (2, 2, 3), (3, 4, 1), (3, 1, 4), (4, 3, 1), (6, 1, 2), (12, 1, 1)]


def test_layout_invariance_stdlib(stdlib_ref):
    stream = stdlib_ref[0]
    G, n_steps = 12, 3
    ref = [sorted(windows(stream, 16, s * G, G)) for s in range(n_steps)]
    for D, b, A in LAYOUTS:
        got = steps(loaders(job(local_batch_size=b, global_batch_size=G), D), A, n_steps)
        assert got == ref, (D, b, A)


def test_resume_with_another_dp_degree(stdlib_ref, tmp_path):
    stream = stdlib_ref[0]
    G = 12
    ref = [sorted(windows(stream, 16, s * G, G)) for s in range(4)]
    # 2 steps on (D=2, b=3, A=2) ...
    first = loaders(job(local_batch_size=3, global_batch_size=G), 2)
    assert steps(first, 2, 2) == ref[:2]
    states = [dl.state_dict() for dl in first]
    assert all(s == states[0] for s in states) and states[0]["consumed_sequences"] == 2 * G
    # ... then on (D=4, b=3, A=1) and (D=3, b=2, A=2): steps 2 and 3 follow
    for D, b, A in [(4, 3, 1), (3, 2, 2), (1, 12, 1)]:
        second = loaders(job(local_batch_size=b, global_batch_size=G), D)
        for dl in second:
            dl.load_state_dict(states[0])
        assert steps(second, A, 2) == ref[2:], (D, b, A)
    # through DCP: a checkpoint of a 2-rank layout loads into rank 2 of a 3-rank layout
    import torch.distributed.checkpoint as dcp

    dcp.save({"dataloader": first[1]}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    third = loaders(job(local_batch_size=4, global_batch_size=G), 3)
    dcp.load({"dataloader": third[2]}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert third[2].consumed_sequences == 2 * G
    x, _ = next(iter(third[2]))
    assert torch.equal(x["input"], torch.tensor([w[:-1] for w in windows(stream, 16, 2 * G + 8, 4)]))
    with pytest.raises(ValueError, match="seq_len"):
        loaders(job(seq_len=32, local_batch_size=3), 1)[0].load_state_dict(states[0])
    with pytest.raises(ValueError, match="consumed_sequences"):
        loaders(job(), 1)[0].load_state_dict({"dp_rank_0": b"", "world_size": 2})


def test_workers_give_the_same_batches(stdlib_ref):
    stream = stdlib_ref[0]
    dls = loaders(job(local_batch_size=2, num_workers=2), 2)
    got = steps(dls, 1, 3)
    assert got == [sorted(windows(stream, 16, 4 * s, 4)) for s in range(3)]


def write_hf_assets(folder: pathlib.Path, corpus_lines):
    """A tiny WordLevel tokenizer trained here, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus_lines, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return tok


LINES = [
    f"line {i} says {' '.join(['alpha', 'beta', 'gamma', 'delta'][: 1 + i % 4])} and {i * 7 % 13}" for i in range(40)
]


def test_hf_local_file_with_tokenizer_json(tmp_path):
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(LINES)))
    ref_tok = write_hf_assets(tmp_path / "assets", LINES)
    bos, eos = ref_tok.token_to_id("<s>"), ref_tok.token_to_id("</s>")
    stream = [t for line in LINES for t in (bos, *ref_tok.encode(line).ids, eos)]
    G = 6

    def jc(D, b):
        return job(
            "hf",
            seq_len=8,
            local_batch_size=b,
            global_batch_size=G,
            dataset_path=str(data),
            assets=str(tmp_path / "assets"),
        )

    tok = build_tokenizer(jc(1, 6))
    assert tok.get_vocab_size() == ref_tok.get_vocab_size() and tok.bos_id == bos and tok.eos_id == eos
    n_steps = len(stream) // (9 * G) + 2  # runs past the end: the second epoch wraps around
    ref = [sorted(windows(stream, 8, s * G, G)) for s in range(n_steps)]
    for D, b, A in [(1, 6, 1), (2, 1, 3), (3, 2, 1), (6, 1, 1)]:
        assert steps(loaders(jc(D, b), D), A, n_steps) == ref, (D, b, A)
    # the stdlib corpus through the same tokenizer: lengths found lazily, only the first file read
    (dl,) = loaders(job("stdlib", seq_len=8, local_batch_size=3, assets=str(tmp_path / "assets")), 1)
    first = stdlib_reference_files()[0].read_text()
    x, y = next(iter(dl))
    assert torch.cat([x["input"], y[:, -1:]], 1).tolist() == [
        list(w) for w in windows([bos, *ref_tok.encode(first).ids], 8, 0, 3)
    ]
    assert dl.dataset.total_tokens is None and len(dl.dataset._ends) == 1


def test_hf_text_file_with_byte_tokenizer(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(LINES[:5] + [""] + LINES[5:12]) + "\n")  # the empty line adds no tokens
    stream = frame([line.encode() for line in LINES[:12]])
    jc = job("hf", seq_len=10, local_batch_size=2, global_batch_size=4, dataset_path=str(data))
    assert isinstance(build_tokenizer(jc), ByteTokenizer)
    n_steps = len(stream) // 44 + 2
    ref = [sorted(windows(stream, 10, s * 4, 4)) for s in range(n_steps)]
    assert steps(loaders(jc, 2), 1, n_steps) == ref
    assert (
        steps(
            loaders(job("hf", seq_len=10, local_batch_size=1, global_batch_size=4, dataset_path=str(data)), 1),
            4,
            n_steps,
        )
        == ref
    )


def test_clear_errors(tmp_path):
    def build(jc, dp=1):
        return loaders(jc, dp)

    with pytest.raises(
        ValueError, match=r"training.dataset = 'c4'.*\['stdlib', 'hf', 'chat_example', 'rollouts_example'\]"
    ):
        build(job("c4"))
    with pytest.raises(ValueError, match="needs training.dataset_path"):
        build(job("hf"))
    with pytest.raises(ValueError, match="does not exist"):
        build(job("hf", dataset_path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match="use training.dataset = 'hf'"):
        build(job("stdlib", dataset_path=str(tmp_path)))
    bad = tmp_path / "corpus.xml"
    bad.write_text("<a/>")
    with pytest.raises(ValueError, match="unsupported file type '.xml'"):
        build(job("hf", dataset_path=str(bad)))
    nocol = tmp_path / "nocol.jsonl"
    nocol.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"no 'text' column \(columns: \['body'\]\)"):
        build(job("hf", dataset_path=str(nocol)))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no tokens"):  # found when first read (lengths are lazy)
        next(iter(build(job("hf", dataset_path=str(empty)))[0]))
    with pytest.raises(ValueError, match="multiple of training.local_batch_size x dp degree = 2 x 2"):
        build(job(local_batch_size=2, global_batch_size=6), dp=2)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        build_tokenizer(job(assets=str(tmp_path / "nope")))
    (tmp_path / "weights").mkdir()
    with pytest.raises(FileNotFoundError, match="holds none of"):
        build_tokenizer(job(assets=str(tmp_path / "weights")))
