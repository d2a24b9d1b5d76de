"""The weight stream (checkpoint/stream.py) against the HF export of the same checkpoint: the debug
model from the seed checkpoint, streamed on 4 ranks at tp 2 x dp 2 with experts on ep 2 x etp 2,
and at pp 2 x dp 2 with experts on ep 2, gives every tensor of `python -m titan_fold.hf export`
bit for bit, on every rank (dst None) or on rank 0 only (dst 0), while the bytes of gathered
tensors alive at once on a rank stay within the largest group (one block, the embedding, or the
norm with the head). The API's logprobs at the tp layout equal transformers' on the exported
folder. In one process, each family's debug model streams what its HF adapter makes of the whole
state dict. A model without HF names, non-zero aux-free biases where HF has none, and a batch
that does not fit the step are refused in one line. save_hub's refusal of a non-empty folder: tests/test_api.py."""

import copy
import json
import os
import re
import weakref

import pytest
import torch
import torch.distributed as dist
import transformers
from launcher import run_ranks

from titan_fold.api import pack_rollouts
from titan_fold.checkpoint.files import read_hf_folder
from titan_fold.checkpoint.stream import NotExportable, check_exportable, hf_weights
from titan_fold.common.errors import UserError
from titan_fold.data.rollouts import RoutingShape
from titan_fold.hf import main as hf_main
from titan_fold.models import FLAVORS, Transformer
from titan_fold.models.hf_adapter import ADAPTERS

LAYOUTS = {
    "tp2_dp2_ep2_etp2": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.expert_tensor_parallel_degree",
        "2",
    ],
    "pp2_dp2_ep2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"],
}


RECORDS = [  # the same on every rank (the batch ranks may differ; the tp ranks may not)
    {"tokens": [5, 9, 17, 33, 2, 71, 8, 8, 40, 11, 3, 99, 250, 7], "loss_mask": [0] * 5 + [1] * 9},
    {"tokens": [300, 12, 4, 4, 61, 18, 200, 5, 1, 77, 31, 6, 9, 100, 101, 102], "loss_mask": [0] * 4 + [1] * 12},
]
for record in RECORDS:  # the rollout fields logprobs does not read
    record.update(advantages=1.0, logprobs=[0.0] * len(record["tokens"]))


class GatheredBytes:
    """The bytes of gathered tensors alive at once on this rank, at their peak: every result of
    DTensor.full_tensor and every buffer a pp transfer fills (broadcast, recv), each counted
    (its elements' bytes) from its making until its storage is freed (views and detached
    copies keep it)."""

    def __init__(self):
        self.alive: dict[int, int] = {}  # id of a tracked storage -> its bytes
        self.peak = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()  # one Python object per storage, alive as long as the storage
        if id(storage) not in self.alive:
            self.alive[id(storage)] = t.numel() * t.element_size()
            self.peak = max(self.peak, sum(self.alive.values()))
            weakref.finalize(storage, self.alive.pop, id(storage))
        return t

    def install(self) -> None:
        from torch.distributed.tensor import DTensor

        full_tensor, broadcast, recv = DTensor.full_tensor, dist.broadcast, dist.recv

        def counted_full_tensor(self_, *args, **kwargs):
            return self.track(full_tensor(self_, *args, **kwargs))

        def counted_broadcast(tensor, *args, **kwargs):
            self.track(tensor)
            return broadcast(tensor, *args, **kwargs)

        def counted_recv(tensor, *args, **kwargs):
            self.track(tensor)
            return recv(tensor, *args, **kwargs)

        DTensor.full_tensor = counted_full_tensor  # this forked rank's class only
        dist.broadcast, dist.recv = counted_broadcast, counted_recv


def group_bytes(reference: dict[str, torch.Tensor]) -> dict[str, int]:
    """The bytes of each group the stream gathers at once, from the HF tensors' names."""
    out: dict[str, int] = {}
    for name, t in reference.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        group = m.group(0) if m else ("embedding" if "embed_tokens" in name else "head")
        out[group] = out.get(group, 0) + t.numel() * t.element_size()
    return out


def stream_worker(rank: int, port: int, out_dir: str, layout: str, seed: str, reference: str) -> None:
    from titan_fold.api import Trainer

    want = read_hf_folder(reference)
    meter = GatheredBytes()
    meter.install()
    trainer = Trainer.from_config(
        "debug_moe.toml",
        [
            "--job.dump_folder",
            os.path.join(out_dir, "run"),
            "--checkpoint.enable",
            "--checkpoint.initial_load_path",
            seed,
            *LAYOUTS[layout],
        ],
    )
    report = {}
    for dst in (None, 0):
        names, wrong = [], []
        for name, t in trainer.weights(dst=dst):
            names.append(name)
            if name not in want or not torch.equal(t, want[name]):
                wrong.append(name)
            del t  # the consumer holds no tensor past its turn
        report[str(dst)] = {"names": names, "wrong": wrong}
    report["peak"] = meter.peak
    if trainer.trainer.parallel_dims.pp == 1:
        report["logprobs"] = [lp.tolist() for lp in trainer.logprobs(RECORDS)]
    trainer.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, seed_checkpoint) -> str:
    """The seed checkpoint through `python -m titan_fold.hf export`."""
    folder = str(tmp_path_factory.mktemp("export") / "hf")
    hf_main(["export", seed_checkpoint, folder, "--model.name", "qwen2_moe", "--model.flavor", "debug"])
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_stream_equals_the_hf_export(layout, reference, seed_checkpoint, tmp_path):
    run_ranks(stream_worker, 4, tmp_path, layout, seed_checkpoint, reference)
    want = read_hf_folder(reference)
    groups = group_bytes(want)
    assert len(groups) == 4 + 2  # the debug model's blocks, the embedding, the head
    largest_tensor = max(t.numel() * t.element_size() for t in want.values())
    hf = None
    for rank in range(4):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(got["None"]["names"]) == sorted(want), (layout, rank)  # every tensor once
        assert got["None"]["wrong"] == [], (layout, rank)
        assert sorted(got["0"]["names"]) == (sorted(want) if rank == 0 else []), (layout, rank)
        assert got["0"]["wrong"] == [], (layout, rank)
        # a rank holds one group's gathered tensors at a time; the meter sees at least the largest tensor
        assert largest_tensor <= got["peak"] <= max(groups.values()), (layout, rank, got["peak"], groups)
        if "logprobs" in got:  # the folded model's log-probs, against transformers on the exported folder
            hf = hf or transformers.AutoModelForCausalLM.from_pretrained(reference).eval()
            for record, lp in zip(RECORDS, got["logprobs"], strict=True):
                tokens = torch.tensor(record["tokens"])
                with torch.no_grad():
                    logits = hf(tokens[None]).logits[0, :-1]  # [s - 1, vocab]
                expected = torch.log_softmax(logits.float(), -1).gather(-1, tokens[1:, None]).squeeze(-1)
                torch.testing.assert_close(torch.tensor(lp[1:]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "family,mtp_layers,words",
    [
        pytest.param("llama3", 0, "model.name = 'llama3': Hugging Face names exist for", id="family"),
        pytest.param("deepseek_v3", 1, "mtp.num_layers = 1: the weight stream has no", id="mtp"),
    ],
)
def test_a_model_without_hf_names_is_refused_in_one_line(family, mtp_layers, words):
    check_exportable("deepseek_v3", 0)  # what the stream covers passes
    with pytest.raises(NotExportable) as e:
        check_exportable(family, mtp_layers)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_a_batch_that_does_not_fit_the_step_is_refused():
    shape = RoutingShape(vocab_size=100, num_experts=8, top_k=2, moe_layers=2)
    record = {"tokens": list(range(10)), "loss_mask": [0] + [1] * 9, "advantages": 1.0, "logprobs": [-1.0] * 10}
    records = [record] * 3  # a row of 16 holds one
    packed = pack_rollouts(records[:2], shape, seq_len=16, local_batch_size=1, microbatches=2)
    assert [p for p in packed.places] == [(0, 0, 0, 10), (1, 0, 0, 10)]
    with pytest.raises(UserError, match="3 rollout records pack into 3 rows of training.seq_len = 16 tokens; a step"):
        pack_rollouts(records, shape, seq_len=16, local_batch_size=1, microbatches=2)
    short = {**record, "loss_mask": [0, 1]}
    with pytest.raises(UserError, match="rollout record 1: 'loss_mask' has 2 values but 'tokens' has 10"):
        pack_rollouts([record, short], shape, seq_len=16, local_batch_size=1, microbatches=2)


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_every_family_streams_the_adapters_tensors(family):
    """One process, each family's debug model (DeepSeek's MLA split kv_a rows joined): the stream
    gives what the HF adapter makes of the whole state dict, tensor for tensor."""
    args = copy.deepcopy(FLAVORS[family]["debug"])
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    want = ADAPTERS[family](args).to_hf(model.state_dict())
    got = list(hf_weights([model], args, family))
    assert sorted(name for name, _ in got) == sorted(want)
    for name, t in got:
        assert torch.equal(t, want[name]), name


def test_nonzero_router_biases_are_refused_before_any_gather():
    """A family whose HF model has no aux-free bias: refused, as the HF export refuses it."""
    args = copy.deepcopy(FLAVORS["qwen3_moe"]["debug"])
    args.moe.load_balance = "aux_free"
    model = Transformer(args)
    model.init_weights()
    assert list(hf_weights([model], args, "qwen3_moe"))  # zero biases: streamed
    model.layers["2"].moe.router.expert_bias.fill_(0.1)
    with pytest.raises(UserError, match=r"aux-free router biases are not zero \(layers.2.moe.router.expert_bias"):
        hf_weights([model], args, "qwen3_moe")
