"""Context parallelism over packed documents (parallel/cp_documents.py): the deal of blocks
against its bound and an exhaustive search; each part's positions, mask and FlexAttention block
mask against the one-rank ones; every gradient of Qwen3-MoE and DeepSeek-V3 (MLA) at cp2, cp4
and cp2 x tp2 on gloo ranks; and through the trainer against one rank on packed chat samples of
very different lengths, Qwen3-MoE at every cp layout (cp2, cp4, cp2 x tp2, cp2 x ep2, cp2 with
pp2) and DeepSeek-V3 at cp2 x ep2 and cp2 with pp2."""

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_matches_one_rank, torchrun, train_from_seed
from launcher import end_rank_checks, fork_ranks, run_checks, start_rank

from titan_fold.models.documents import document_attention, document_mask, document_positions
from titan_fold.parallel.attention import cp_positions
from titan_fold.parallel.cp_documents import block_work, blocks_per_rank, cp_order, deal_blocks


def packed(lengths: list[int]) -> torch.Tensor:
    """[1, sum(lengths)] document ids of documents of these lengths, packed in turn."""
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]


def rank_work(document_ids: torch.Tensor, order: torch.Tensor, cp: int) -> list[int]:
    """Each cp rank's (query, key) pairs under the one-rank mask, counted from the mask itself."""
    pairs = document_mask(document_ids)[0, 0].sum(1)  # [s]: keys each query sees
    n = order.shape[1] // cp
    return [int(pairs[order[0, r * n : (r + 1) * n]].sum()) for r in range(cp)]


# very different lengths: a long document beside short ones, then padding-like tails
SAMPLES = [
    [200, 20, 9, 27],
    [7, 3, 240, 6],
    [256],
    [1] * 16 + [240],
    [60, 60, 60, 60, 16],
]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lengths", SAMPLES)
def test_deal_is_a_permutation_of_equal_parts_within_its_bound(lengths, cp):
    ids = packed(lengths)
    s = ids.shape[1]
    order = cp_order(ids, cp)
    assert sorted(order[0].tolist()) == list(range(s))  # every token once
    blocks = cp * blocks_per_rank(s, cp)
    work = block_work(ids, blocks)[0]
    loads = rank_work(ids, order, cp)
    assert sum(loads) == int(work.sum())
    # the bound the module docstring proves
    assert max(loads) - min(loads) <= int(work.max() - work.min()), (loads, work.tolist())


def test_deal_beats_the_two_chunk_split():
    """A long document, then short ones: the two-chunk split gives the long one's end to the
    middle chunks' ranks, the short ones' little work to the last chunk's."""
    ids = packed([1536] + [8] * 64)
    for cp in (2, 4):
        chunks = torch.cat([cp_positions(r, cp, 2048) for r in range(cp)])[None]
        dealt = rank_work(ids, cp_order(ids, cp), cp)
        assert max(dealt) < 0.9 * max(rank_work(ids, chunks, cp)), cp


def test_snake_hands_each_rounds_advantage_back():
    """The bound holds for a round-robin deal too (rank 0 first in every round): the snake is
    better where each round's first rank gains. Works 8 7 6 5 on 2 ranks: 8 + 5 and 7 + 6 (a
    round-robin deal gives 8 + 6 and 7 + 5); 8 .. 1 on 4 ranks: 8 + 1, 7 + 2, 6 + 3, 5 + 4."""
    assert deal_blocks(torch.tensor([8, 7, 6, 5]), 2) == [[0, 3], [1, 2]]
    assert deal_blocks(torch.arange(8, 0, -1), 4) == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_one_document_in_two_blocks_per_rank_is_the_two_chunk_split():
    ids = packed([16])
    assert blocks_per_rank(16, 2) == 2
    assert cp_order(ids, 2).view(2, 2, 4)[:, :, 0].tolist() == [[0, 12], [4, 8]]


def test_deal_against_an_exhaustive_search():
    """Small samples: the work per block from the mask itself, and the deal's heaviest rank
    against the best of every split into equal parts, within the bound's margin."""
    for lengths in ([5, 11], [1, 1, 14], [3, 3, 3, 7], [9, 2, 5]):
        ids = packed(lengths)
        work = block_work(ids, 8)[0]
        pairs = document_mask(ids)[0, 0].sum(1).view(8, 2).sum(1)
        assert work.tolist() == pairs.tolist()
        for cp in (2, 4):
            dealt = deal_blocks(work, cp)
            assert sorted(b for rank in dealt for b in rank) == list(range(8))
            assert {len(rank) for rank in dealt} == {8 // cp}
            best = min(max(int(work[list(part)].sum()) for part in parts) for parts in equal_parts(list(range(8)), cp))
            heaviest = max(int(work[rank].sum()) for rank in dealt)
            assert best <= heaviest <= best + int(work.max() - work.min()), (lengths, cp, best, heaviest)


def equal_parts(items: list[int], n: int):
    """Every split of items into n parts of equal size (as sets, part order ignored)."""
    if n == 1:
        yield [items]
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, len(items) // n - 1):
        left = [i for i in rest if i not in others]
        for parts in equal_parts(left, n - 1):
            yield [[first, *others], *parts]


@pytest.mark.parametrize("cp", [2, 4])
def test_each_part_has_the_one_rank_positions_and_mask(cp):
    ids = torch.cat([packed([20, 3, 9]), packed([1, 31])])  # [2, 32]: two samples, dealt apart
    order = cp_order(ids, cp)
    assert not torch.equal(order[0], order[1])
    full_positions, full_mask = document_positions(ids), document_mask(ids)  # [2, 32], [2, 1, 32, 32]
    cp_ids = ids.gather(1, order)
    n = 32 // cp
    for part in range(cp):
        positions, mask = document_attention(cp_ids, order, part, cp)
        rows = order[:, part * n : (part + 1) * n]
        assert torch.equal(positions, full_positions.gather(1, rows))
        want = torch.stack([full_mask[i, 0][rows[i]][:, order[i]] for i in range(2)])[:, None]
        assert torch.equal(mask, want)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_parts_block_mask_holds_every_attending_pair(cp):
    """The FlexAttention BlockMask of each part, built from its blocks' bounds on the host
    (models/documents.py: flex_block_mask, block 16 here): every pair that attends lies in a kv
    block it lists, every pair of a full block attends, its mask_mod is the explicit mask, and
    with the dealt blocks a multiple of the tile no listed block is wholly masked."""
    from titan_fold.models.documents import _mask_mod, flex_block_mask

    # [2, 512]: dealt blocks of 128 (cp2) or 64 (cp4) tokens, whole 16-token tiles
    ids = torch.cat([packed([300, 3, 61, 148]), packed([17, 495])])
    order = cp_order(ids, cp)
    cp_ids, n = ids.gather(1, order), 512 // cp
    for part in range(cp):
        queries = slice(part * n, (part + 1) * n)
        want = document_mask(cp_ids, order, queries)[:, 0]  # [2, n, 512], the explicit mask
        got = flex_block_mask(cp_ids, 16, order, queries)
        mod = _mask_mod(cp_ids, order, queries.start)
        b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(n), torch.arange(512), indexing="ij")
        assert torch.equal(mod(b, None, q, kv), want)
        tiles = want.view(2, n // 16, 16, 32, 16).transpose(2, 3)  # [2, q tiles, kv tiles, 16, 16]
        listed = {(i, j, k) for i, j, k in itertools.product(range(2), range(n // 16), range(32))}
        partial = {
            t for t in listed if t[2] in set(got.kv_indices[t[0], 0, t[1], : got.kv_num_blocks[t[0], 0, t[1]]].tolist())
        }
        full = {
            t
            for t in listed
            if t[2] in set(got.full_kv_indices[t[0], 0, t[1], : got.full_kv_num_blocks[t[0], 0, t[1]]].tolist())
        }
        assert not partial & full
        for t in listed:
            assert (t in partial or t in full) == bool(tiles[t].any()), (part, t)
            assert t not in full or bool(tiles[t].all()), (part, t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: FlexAttention's block mask runs on CUDA")
@pytest.mark.parametrize("cp", [2, 4])
def test_each_part_attends_as_one_rank_with_flex_on_gpu(cp):
    """Each part's queries under its FlexAttention block mask [s/cp, s] over the keys in the cp
    ranks' order (models/documents.py: masked_attention), against SDPA's math under the one-rank
    explicit mask: outputs, and the gradients of q, k and v summed over the parts."""
    from titan_fold.models.documents import masked_attention

    ids = torch.cat([packed([700, 3, 61, 260]), packed([17, 1007])]).cuda()  # [2, 1024]
    order = cp_order(ids.cpu(), cp).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 1024, 64, device="cuda", generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 1024, 64, device="cuda", generator=g, requires_grad=True) for _ in range(2))
    upstream = torch.randn(2, 4, 1024, 64, device="cuda", generator=g)
    mask = document_mask(ids.cpu()).cuda()  # the explicit one-rank mask [2, 1, 1024, 1024]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = masked_attention(q, k, v, mask)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)

    def in_order(x, index):  # [b, heads, s, d] -> the tokens of index [b, n], in its order
        return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))

    cp_ids, n = ids.gather(1, order), 1024 // cp
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for part in range(cp):
        rows = order[:, part * n : (part + 1) * n]
        _, block_mask = document_attention(cp_ids, order, part, cp)
        assert type(block_mask).__name__ == "BlockMask"
        out = masked_attention(in_order(q, rows), in_order(k, order), in_order(v, order), block_mask)
        torch.testing.assert_close(out, in_order(want, rows), rtol=1e-4, atol=1e-5)
        for total, grad in zip(grads, torch.autograd.grad(out, (q, k, v), in_order(upstream, rows)), strict=True):
            total += grad
    for name, total, wanted in zip("qkv", grads, want_grads, strict=True):
        torch.testing.assert_close(total, wanted, rtol=1e-3, atol=1e-5, msg=name)


# --- every gradient under cp and cp x tp against one rank, on 4 gloo ranks

WORLD = 4
# (cp, tp); ranks beyond cp x tp are replicas fed the same batch
MODEL_LAYOUTS = [(2, 1), (4, 1), (2, 2)]
# two samples [2, 64], documents of very different lengths, each sample dealt on its own
DOCUMENTS = [[40, 3, 1, 20], [5, 59]]


def tiny(name: str):
    from titan_fold.models import FLAVORS

    args = FLAVORS[name]["debug"]
    # no balance losses: means over a rank's tokens; two layers (DeepSeek-V3: a dense one first)
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, load_balance="none"), n_layers=2)


def packed_loss(logits: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
    # the trainer's: a sum over the tokens / the global token count
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum") / tokens


def check_model_layout(args, reference, batch, cp: int, tp: int) -> None:
    """The folded model's loss and every parameter's gradient, summed over the ranks that hold
    different tokens, against the one-rank model's."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from titan_fold.models import Transformer
    from titan_fold.parallel.attention import apply_cp, apply_tp
    from titan_fold.parallel.cp_documents import cp_shard_documents
    from titan_fold.parallel.mesh import Layout

    tokens, labels, document_ids = batch
    layout = Layout(WORLD, tp=tp, cp=cp)
    layout.build_mesh("cpu")
    tp_mesh, cp_mesh = layout.attention["tp"], layout.attention["cp"]
    with torch.device("meta"):
        model = Transformer(args)
    if tp > 1:
        apply_tp(model, tp_mesh, loss_parallel=False, sequence_parallel=True)
    apply_cp(model, cp_mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    full = reference.state_dict()
    for name, p in model.named_parameters():
        with torch.no_grad():
            if isinstance(p, DTensor):
                p.to_local().copy_(
                    distribute_tensor(full[name], p.device_mesh, p.placements, src_data_rank=None).to_local()
                )
            else:
                p.copy_(full[name])
    order = cp_order(document_ids, cp)
    local_tokens, local_labels, ids, positions = cp_shard_documents(tokens, labels, document_ids, order, cp_mesh)
    loss = packed_loss(model(local_tokens, positions, document_ids=ids), local_labels, labels.numel())
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_mesh.get_group())
    torch.testing.assert_close(total, reference.loss, rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):  # reduced over tp already
            local = g.to_local().clone()
            dist.all_reduce(local, group=cp_mesh.get_group())
            replicated = all(isinstance(q, Replicate) for q in g.placements)
            got = local if replicated else DTensor.from_local(local, g.device_mesh, g.placements).full_tensor()
        else:  # the experts: partial over the ranks holding other tokens, tp (sequence parallel) and cp
            got = g.clone()
            for group in (tp_mesh, cp_mesh) if tp > 1 else (cp_mesh,):
                dist.all_reduce(got, group=group.get_group())
        want = reference.grads[name]
        assert (got - want).norm() <= 1e-5 * want.norm(), (name, ((got - want).norm() / want.norm()).item())


def model_worker(rank, port, out_dir, names):
    start_rank(rank, port, WORLD)
    from titan_fold.models import Transformer

    failures = []
    for name in names:
        args = tiny(name)
        torch.manual_seed(0)
        reference = Transformer(args)
        reference.init_weights()
        document_ids = torch.cat([packed(lengths) for lengths in DOCUMENTS])  # [2, 64]
        tokens = torch.randint(0, args.vocab_size, document_ids.shape)
        labels = torch.randint(0, args.vocab_size, document_ids.shape)
        loss = packed_loss(reference(tokens, document_ids=document_ids), labels, labels.numel())
        loss.backward()
        reference.loss = loss.detach()
        reference.grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        batch = tokens, labels, document_ids
        failures += run_checks(
            [
                (
                    f"cp{cp} tp{tp}",
                    lambda cp=cp, tp=tp, a=args, r=reference, b=batch: check_model_layout(a, r, b, cp, tp),
                )
                for cp, tp in MODEL_LAYOUTS
            ],
            name,
        )
    end_rank_checks(out_dir, rank, failures)


@pytest.mark.slow
def test_every_gradient_under_cp_and_tp_is_one_ranks(tmp_path):
    failures = fork_ranks(model_worker, WORLD, tmp_path, sorted(MODELS))
    assert not failures, "\n".join(failures)[:20000]


# --- every cp layout against one rank, through the trainer

# no balance losses: means over a pipeline micro-batch, which pp splits further than the others
PLAIN = ("--moe.load_balance", "none", "--moe.aux_loss_coeff", "0", "--moe.z_loss_coeff", "0")
BATCH = ("--training.local_batch_size", "4", "--training.global_batch_size", "8")
CP2 = ("--parallelism.context_parallel_degree", "2")
LAYOUTS = {
    "cp2": (2, CP2),
    "cp4": (4, ("--parallelism.context_parallel_degree", "4")),
    "cp2_tp2": (4, (*CP2, "--parallelism.tensor_parallel_degree", "2")),
    "cp2_ep2": (2, (*CP2, "--parallelism.expert_parallel_degree", "2")),
    "cp2_pp2": (
        4,
        (*CP2, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"),
    ),
}
MODELS = {
    "qwen3_moe": ("--model.name", "qwen3_moe"),
    # MLA with YaRN (the debug flavor's rope)
    "deepseek_v3": ("--model.name", "deepseek_v3"),
}
# DeepSeek-V3 through the trainer where the gloo check above does not reach (ep, pp)
CASES = [("qwen3_moe", layout) for layout in sorted(LAYOUTS)] + [("deepseek_v3", "cp2_ep2"), ("deepseek_v3", "cp2_pp2")]
STEPS = 2


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """model -> a seed checkpoint of it for debug_sft, made once on one rank."""
    made = {}

    def seed(name: str) -> str:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            torchrun(
                1,
                "--job.dump_folder",
                str(root),
                "--checkpoint.enable",
                "--checkpoint.create_seed_checkpoint",
                *MODELS[name],
                config="debug_sft.toml",
            )
            made[name] = str(root / "checkpoint" / "step-0")
        return made[name]

    return seed


@pytest.fixture(scope="module")
def one_rank(seeds, tmp_path_factory):
    """model -> its one-rank run on debug_sft's packed chats without balance losses."""
    runs = {}

    def run(name: str) -> list[dict]:
        if name not in runs:
            folder = tmp_path_factory.mktemp(f"{name}_one")
            runs[name] = train_from_seed(
                folder, 1, seeds(name), STEPS, *MODELS[name], *PLAIN, *BATCH, config="debug_sft.toml"
            )
        return runs[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", CASES)
def test_layout_matches_one_rank(name, layout, seeds, one_rank, tmp_path):
    nproc, degrees = LAYOUTS[layout]
    args = (*MODELS[name], *PLAIN, *BATCH, *degrees)
    got = train_from_seed(tmp_path, nproc, seeds(name), STEPS, *args, config="debug_sft.toml")
    assert_matches_one_rank(one_rank(name), got, layout, keys=("loss", "grad_norm"))


@pytest.mark.slow
def test_balance_losses_under_cp_tp_match_one_rank(seeds, tmp_path):
    """debug_sft's own aux and z losses (Qwen3-MoE): the router's statistics, gathered over cp x
    tp, see each packed sample whole whatever blocks the ranks hold."""
    seed = seeds("qwen3_moe")
    one = train_from_seed(tmp_path / "one", 1, seed, STEPS, *BATCH, config="debug_sft.toml")
    _, degrees = LAYOUTS["cp2_tp2"]
    got = train_from_seed(tmp_path / "cp2_tp2", 4, seed, STEPS, *BATCH, *degrees, config="debug_sft.toml")
    assert one[0]["moe_aux_loss"] > 0
    assert_matches_one_rank(one, got, "cp2_tp2 with balance losses")
