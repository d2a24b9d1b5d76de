"""Planted bugs that the tests must catch: `python -m tests.mutations [NAME ...]`.

Each mutation replaces one piece of text (found exactly once) in a copy of the repository. Its
named tests run first in an unmutated copy (the baseline: each must pass), then with the
mutation planted; it is caught when every named test fails on a test's assertion about values
(tests/outcomes/failures.py: an AssertionError raised by test code, assert_close, pytest.approx).
A crash, another exception, a failing fixture, a collection error or a timeout is not a catch,
and the runner says which. tests/outcomes/pytest_outcomes.py, a pytest plugin, tells the runner
what each test failed on, including the exceptions that ended its ranks and subprocesses.

`--record [NAME ...]` writes the outcomes (of all, or of the named ones, the others kept) to
tests/data/mutation_results.json, each with a fingerprint of the mutation and of its test
files; `--check` lists the entries that are stale, missing or not caught; `--list` prints the
list with the recorded outcomes (docs/running.md quotes it). tests/test_mutations.py checks the
record and the runner itself, and runs the mutations marked `fast` again in the CPU suite.
"""

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "tests" / "data" / "mutation_results.json"
PLUGIN = ROOT / "tests" / "outcomes"  # pytest_outcomes.py, the plugin; taken from here, never from a mutated copy
# what a copy leaves out: history, environments, outputs and caches
IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "outputs", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info"
)
MIN_COUNT = 38  # the suite's floor on the number of mutations caught (tests/test_mutations.py)


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in a phrase
    path: str  # the file it is planted in, from the repository's root
    old: str  # text found exactly once in that file
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail
    fast: bool = False  # run by the CPU suite (tests/test_mutations.py)

    def fingerprint(self, root: Path = ROOT) -> str:
        """Changes with the mutation (its file, text and tests) and with its test files' contents."""
        digest = hashlib.sha256(json.dumps([self.path, self.old, self.new, sorted(self.tests)]).encode())
        for test_file in sorted({t.split("::")[0] for t in self.tests}):
            path = root / test_file
            digest.update(path.read_bytes() if path.exists() else b"missing")
        return digest.hexdigest()[:16]


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "expert_grad_halved",
        "every routed expert's gradient halved (the expert FSDP units' divide factor)",
        "titan_fold/parallel/parallelize.py",
        "        unit.set_gradient_divide_factor(1.0)\n",
        "        unit.set_gradient_divide_factor(2.0 if unit in [m.experts for m in moe_layers(model)] else 1.0)\n",
        # every layout with experts sharded over edp > 1 (FSDP units of their own)
        tuple(
            f"tests/test_equivalence.py::test_layout_matches_one_rank[{layout}]"
            for layout in (
                "dp4_ep2_edp2",
                "c_cp4_dp2_ep2_etp2_edp2",
                "e_hsdp2x2_tp2_ep2_etp2_edp2",
                "f_tp4_dp2_ep2_edp4",
            )
        ),
    ),
    Mutation(
        "expert_norm_not_reduced",
        "the expert mesh's all-reduce of the gradient norm skipped (clip.full_norm)",
        "titan_fold/parallel/clip.py",
        "    dist.all_reduce(power, op=dist.ReduceOp.SUM, group=group)\n",
        "",
        # every layout with a mesh whose gradients are partial over two dims or more (not dp2 x ep2)
        (
            *(
                f"tests/test_equivalence.py::test_layout_matches_one_rank[{layout}]"
                for layout in (
                    "dp4_ep2_edp2",
                    "dp8_ep4_etp2",
                    "a_tp2_cp2_dp2_ep4_etp2",
                    "b_tp2_dp4_ep8_moe_recompute",
                    "c_cp4_dp2_ep2_etp2_edp2",
                    "e_hsdp2x2_tp2_ep2_etp2_edp2",
                    "f_tp4_dp2_ep2_edp4",
                )
            ),
            "tests/test_equivalence.py::test_full_sequence_dropping_matches_one_rank[cp2_tp2_dp2_ep4_etp2_drop]",
        ),
    ),
    Mutation(
        "router_grad_tp_sum_dropped",
        "the router gate's gradient not summed over tp (its token rows taken as replicated)",
        "titan_fold/parallel/placement.py",
        "        return tuple(DTensor.from_local(x, mesh, [Shard(0)], run_check=False) for x in inputs)\n",
        "        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)\n",
        ("tests/test_equivalence.py::test_layout_matches_one_rank[f_tp4_dp2_ep2_edp4]",),
    ),
    Mutation(
        "router_stats_over_cp_only",
        "the router's aux-loss statistics summed over cp only, not cp x tp",
        "titan_fold/parallel/experts.py",
        '        seq_mesh=layout.get_optional_mesh("cp_tp"),\n',
        '        seq_mesh=layout.get_optional_mesh("cp"),\n',
        (
            "tests/test_equivalence.py::test_layout_matches_one_rank[a_tp2_cp2_dp2_ep4_etp2]",
            "tests/test_equivalence.py::test_layout_matches_one_rank[f_tp4_dp2_ep2_edp4]",
        ),
    ),
    Mutation(
        "edp_reduce_scatter_skipped",
        "routed experts left out of FSDP over edp: their gradients never reduced over edp",
        "titan_fold/parallel/placement.py",
        '                fsdp_mesh=("edp",) if layout.edp > 1 else (),\n',
        "                fsdp_mesh=(),\n",
        ("tests/test_equivalence.py::test_layout_matches_one_rank[dp4_ep2_edp2]",),
    ),
    Mutation(
        "cp_chunk_order_wrong",
        "cp's gathered K/V chunks put in rank order, not the load-balanced mirror order",
        "titan_fold/parallel/attention.py",
        "        order = [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]\n",
        "        order = [2 * g if g < cp else 2 * (g - cp) + 1 for g in range(2 * cp)]\n",
        ("tests/test_attention_parallel.py::test_attention_parallel_matches_one_rank",),
    ),
    Mutation(
        "router_ties_to_higher_expert",
        "the Triton router's argmax passes take the higher expert or group among equals",
        "titan_fold/moe/router_triton.py",
        "tl.min(tl.where(x == top[:, None], cols[None, :], x.shape[1]), axis=1)",
        "tl.max(tl.where(x == top[:, None], cols[None, :], -1), axis=1)",
        ("tests/test_moe_fast_paths.py::test_fused_route_equals_route_whole_in_the_triton_interpreter",),
        fast=True,
    ),
    Mutation(
        "router_group_ties_to_higher",
        "the Triton router keeps the higher group among groups of equal scores",
        "titan_fold/moe/router_triton.py",
        "kept = _first_max(group_score, gcols)",
        "kept = tl.max(tl.where(group_score == tl.max(group_score, axis=1)[:, None], gcols[None, :], -1), axis=1)",
        ("tests/test_moe_fast_paths.py::test_fused_route_equals_route_whole_in_the_triton_interpreter",),
    ),
    Mutation(
        "group_offsets_off_by_one",
        "each expert's row offsets searched after its rows: counts and starts off by one expert",
        "titan_fold/moe/rows.py",
        "    bounds = torch.searchsorted(sorted_key, torch.arange(num_groups + 1, device=key.device, dtype=narrow))  # [G + 1]\n",
        "    bounds = torch.searchsorted(sorted_key, torch.arange(num_groups + 1, device=key.device, dtype=narrow), right=True)\n",
        (
            "tests/test_moe_layer.py::test_group_by[40-7]",
            "tests/test_moe_layer.py::test_layer_matches_reference[2-8-None-probs-0.0-True-dtype0]",
        ),
        fast=True,
    ),
    Mutation(
        "token_drop_keeps_lowest",
        "token drop by probs keeps the lowest routing weights, not the highest",
        "titan_fold/moe/dispatcher.py",
        "        prio = torch.sort(probs.flatten(), descending=True, stable=True).indices\n",
        "        prio = torch.sort(probs.flatten(), descending=False, stable=True).indices\n",
        ("tests/test_moe_layer.py::test_layer_matches_reference[2-8-1.0-probs-0.0-True-dtype0]",),
    ),
    Mutation(
        "expert_bias_not_checkpointed",
        "the aux-free router bias left out of the state dict: a resume restarts it at zero",
        "titan_fold/moe/router.py",
        '        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)\n',
        '        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False)\n',
        (
            "tests/test_checkpoint.py::test_checkpoint_holds_every_state",
            "tests/test_checkpoint.py::test_resume_two_ranks_ep2_on_one_rank",
        ),
    ),
    Mutation(
        "mtp_target_offset",
        "the MTP layer's targets one token too far ahead (future_tokens)",
        "titan_fold/models/mtp.py",
        "shifted(labels, k + 1)], dim=-1)",
        "shifted(labels, k + 2)], dim=-1)",
        ("tests/test_deepseek_v3.py::test_mtp_loss_against_a_written_out_computation",),
    ),
    Mutation(
        "fp8_scale_transposed",
        "the FP8 input gradient's weight quantized per output row, scaled per input column",
        "titan_fold/moe/fp8.py",
        "        wt_q, wt_s = quantize(w.transpose(1, 2))  # per (expert, input column), amax over the output rows\n",
        "        wt_q, wt_s = quantize(w)[0].transpose(1, 2), quantize(w.transpose(1, 2))[1]\n",
        ("tests/test_fp8.py::test_grouped_linear_and_grads_against_float64[cpu]",),
        fast=True,
    ),
    Mutation(
        "wgrad_flushed_twice",
        "the delayed weight-gradient queue not emptied by flush: a later flush adds it again",
        "titan_fold/moe/wgrad.py",
        "        pending, self.pending = self.pending, []\n",
        "        pending = self.pending\n",
        ("tests/test_wgrad.py::test_delayed_wgrad_matches",),
    ),
    Mutation(
        "static_exchange_reads_padding",
        "the static exchange counts each block's padding rows as its last expert's",
        "titan_fold/moe/exchange.py",
        "        return torch.searchsorted(ends, within, right=True).flatten()  # [R_all], E_loc = padding\n",
        "        return torch.searchsorted(ends, within, right=True).clamp(max=rows_of_source.shape[1] - 1).flatten()\n",
        ("tests/test_static_exchange.py::test_static_exchange_matches_exact_and_one_rank",),
    ),
    Mutation(
        "aux_free_bias_sign_flipped",
        "the aux-free bias update's sign flipped: overloaded experts made more attractive",
        "titan_fold/moe/layer.py",
        "torch.sign(load.mean() - load)",
        "torch.sign(load - load.mean())",
        ("tests/test_moe_layer.py::test_aux_free_bias",),
    ),
    Mutation(
        "aux_free_load_over_dp_only",
        "the aux-free expert load summed over dp only, not every rank of the stage (cp, tp)",
        "titan_fold/trainer/fold_trainer.py",
        '            stage_mesh = self.parallel_dims.get_optional_mesh("stage")\n',
        '            stage_mesh = self.parallel_dims.get_optional_mesh("batch")\n',
        ("tests/test_equivalence_deepseek.py::test_deepseek_layout_matches_one_rank[tp2]",),
    ),
    Mutation(
        "mtp_embedding_grad_not_synced",
        "under pp the MTP layers' embedding copy keeps its own gradient (no sum with stage 0's)",
        "titan_fold/parallel/pipeline.py",
        "        grad.add_(buf)\n",
        "",
        ("tests/test_equivalence_deepseek.py::test_deepseek_layout_matches_one_rank[pp2]",),
    ),
    Mutation(
        "yarn_floor_ceil_swapped",
        "YaRN's ramp bounds rounded inward (ceil low, floor high), not outward",
        "titan_fold/models/mla.py",
        "        low, high = math.floor(low), math.ceil(high)\n",
        "        low, high = math.ceil(low), math.floor(high)\n",
        ("tests/test_deepseek_v3.py::test_import_parity_and_exact_export[q_lora_yarn_groups]",),
        fast=True,
    ),
    Mutation(
        "mla_mscale_not_squared",
        "MLA's softmax scale times YaRN's mscale once, not squared",
        "titan_fold/models/deepseek_v3.py",
        "            scale *= yarn_mscale(self.rope_factor, self.mscale_all_dim) ** 2\n",
        "            scale *= yarn_mscale(self.rope_factor, self.mscale_all_dim)\n",
        ("tests/test_deepseek_v3.py::test_import_parity_and_exact_export[yarn_mscale_half_split_tied]",),
    ),
    Mutation(
        "etp_reduce_scatter_mean",
        "the dispatcher's reduce-scatter over etp averages the partial w2 products",
        "titan_fold/moe/dispatcher.py",
        "    return parts.view(n, mine, *y.shape[1:]).sum(0, dtype=y.dtype)\n",
        "    return parts.view(n, mine, *y.shape[1:]).mean(0, dtype=y.dtype)\n",
        ("tests/test_dispatcher.py::test_dispatcher_matches_reference",),
    ),
    Mutation(
        "copy_gradient_dropped",
        "the copies of hot experts give their home experts no gradient",
        "titan_fold/moe/replicas.py",
        "        return summed.new_zeros(ctx.shape).index_add(0, rows, summed), None, None, None\n",
        "        return None, None, None, None\n",
        (
            "tests/test_hot_replicas.py::test_replicas_match_reference",
            "tests/test_hot_replicas_train.py::test_pp2_ep2_with_copies_matches_one_rank",
        ),
    ),
    Mutation(
        "copy_gradient_twice",
        "the copies' gradients added to their home experts twice",
        "titan_fold/moe/replicas.py",
        "        return summed.new_zeros(ctx.shape).index_add(0, rows, summed), None, None, None\n",
        "        return summed.new_zeros(ctx.shape).index_add(0, rows, 2 * summed), None, None, None\n",
        (
            "tests/test_hot_replicas.py::test_replicas_match_reference",
            "tests/test_hot_replicas_train.py::test_pp2_ep2_with_copies_matches_one_rank",
        ),
    ),
    Mutation(
        "ranks_print_their_line_under_the_launcher",
        "under python -m titan_fold.run the ranks print their refusal too (the launcher prints it)",
        "titan_fold/common/errors.py",
        "            return  # the launcher prints the first failing rank's line\n",
        "            pass\n",
        tuple(
            f"tests/test_run.py::test_refusal_is_one_line_exit_2_whichever_rank_fails_first[{case}]"
            for case in ("rank_1_fails_first", "rank_0_fails_first")
        ),
    ),
    Mutation(
        "launcher_ignores_when_ranks_failed",
        "the launcher's first failing rank taken in the agent's order, not by the ranks' clocks",
        "titan_fold/run.py",
        'failures[r].error_file_data.get("time_ns", 0)',
        "0",
        tuple(
            f"tests/test_run.py::test_first_failure[{case}]" for case in ("earlier_line", "earlier_line_found_later")
        ),
        fast=True,
    ),
    Mutation(
        "shrink_drops_the_folding",
        "--debug.shrink sets every degree to 1 instead of keeping the folding's shape where it fits",
        "titan_fold/trainer/shrink.py",
        "(d for d in divisors(world_size) if d <= wanted[key])",
        "(d for d in divisors(world_size) if d <= 1)",
        tuple(
            f"tests/test_shrink.py::test_shrunk_config_keeps_the_folding_where_it_fits[{case}]"
            for case in ("qwen3_30b_a3b.toml-2", "mixtral_8x22b.toml-2")
        ),
        fast=True,
    ),
    Mutation(
        "neighbours_ignore_given_degrees",
        "a refusal's valid neighbours chosen without the other degrees as given (dp_shard, edp, ...)",
        "titan_fold/parallel/mesh.py",
        "fits(self.world_size, self._given | others | {name: d}, sizes)",
        "fits(self.world_size, others | {name: d}, sizes)",
        tuple(
            f"tests/test_layout.py::test_every_proposed_neighbour_passes_or_moves_to_a_later_check[{case}]"
            for case in ("qwen3_30b_at_2", "dp_shard_given")
        ),
        fast=True,
    ),
    Mutation(
        "muon_newton_schulz_one_step_short",
        "Muon's Newton-Schulz runs one step fewer than muon_ns_steps",
        "titan_fold/trainer/muon.py",
        'return newton_schulz(stack, group["ns_coefficients"], group["ns_steps"], NS_EPS, dtype)',
        'return newton_schulz(stack, group["ns_coefficients"], group["ns_steps"] - 1, NS_EPS, dtype)',
        (
            "tests/test_muon.py::test_matrices_step_as_torch_muon[True-match_rms_adamw]",
            "tests/test_muon.py::test_matrices_step_as_torch_muon[False-original]",
            "tests/test_muon.py::test_each_expert_matrix_steps_as_torch_muon",
        ),
    ),
    Mutation(
        "muon_scale_of_the_shorter_side",
        "Muon's match_rms_adamw scale takes the matrix's shorter side, not its longer",
        "titan_fold/trainer/muon.py",
        "return 0.2 * math.sqrt(max(a, b)) if lr_adjust",
        "return 0.2 * math.sqrt(min(a, b)) if lr_adjust",
        (
            "tests/test_muon.py::test_matrices_step_as_torch_muon[True-match_rms_adamw]",
            "tests/test_muon.py::test_each_expert_matrix_steps_as_torch_muon",
        ),
    ),
    Mutation(
        "muon_shards_orthogonalized_alone",
        "sharded Muon: each rank orthogonalizes its own shard of a matrix, not the whole matrix",
        "titan_fold/parallel/orthogonalize.py",
        "out.update(self._exchange(self.mesh_of[key], self.groups[key], entries, local_of, orthogonalize, dtype))",
        "out.update({id(e): orthogonalize(local_of[id(e)].reshape(local_of[id(e)].shape[:-2].numel(), "
        "*local_of[id(e)].shape[-2:]).to(dtype)).reshape(local_of[id(e)].shape) for e in entries})",
        ("tests/test_muon_folding.py::test_one_muon_step_under_each_folding_is_one_ranks",),
    ),
    Mutation(
        "document_mask_crosses_documents",
        "the packed documents' mask lets a token see the earlier documents (causal only)",
        "titan_fold/models/documents.py",
        "    allowed = same & (delta >= 0)\n",
        "    allowed = delta >= 0\n",
        (
            "tests/test_documents.py::test_positions_and_mask_of_a_packed_row",
            "tests/test_documents.py::test_packed_equals_each_document_alone[qwen3_moe]",
            "tests/test_documents.py::test_packed_equals_each_document_alone[deepseek_v3]",
        ),
    ),
    Mutation(
        "document_positions_not_restarted",
        "positions run on across packed documents instead of restarting at 0 in each",
        "titan_fold/models/documents.py",
        "    return index - first\n",
        "    return index\n",
        (
            "tests/test_documents.py::test_positions_and_mask_of_a_packed_row",
            "tests/test_cp_documents.py::test_each_part_has_the_one_rank_positions_and_mask[2]",
            "tests/test_cp_documents.py::test_each_part_has_the_one_rank_positions_and_mask[4]",
            "tests/test_cp_documents.py::test_deal_against_an_exhaustive_search",
        ),
    ),
    Mutation(
        "flex_full_block_across_documents",
        "the FlexAttention block mask marks full a block pair that only starts in one document",
        "titan_fold/models/documents.py",
        "full = some & one & (",
        "full = some & (",
        tuple(
            f"tests/test_documents.py::test_block_mask_from_documents_equals_flex_evaluating_every_pair[lengths{i}]"
            for i in (1, 3)  # [16] * 16 and [256] have no block of two documents
        )
        + tuple(
            f"tests/test_cp_documents.py::test_each_parts_block_mask_holds_every_attending_pair[{cp}]" for cp in (2, 4)
        ),
    ),
    Mutation(
        "cp_deal_round_robin",
        "cp over documents deals the blocks round-robin, not in a snake",
        "titan_fold/parallel/cp_documents.py",
        "deal = range(cp) if (round_start // cp) % 2 == 0 else range(cp - 1, -1, -1)",
        "deal = range(cp)",
        (
            "tests/test_cp_documents.py::test_snake_hands_each_rounds_advantage_back",
            "tests/test_cp_documents.py::test_one_document_in_two_blocks_per_rank_is_the_two_chunk_split",
        ),
    ),
    Mutation(
        "chat_label_trained_by_its_own_token",
        "chat SFT: a label is trained when its input token is an answer's, not the label itself",
        "titan_fold/data/dataset.py",
        "keep = trained[1:] & (document_ids[1:] == document_ids[:-1])",
        "keep = trained[:-1] & (document_ids[1:] == document_ids[:-1])",
        ("tests/test_chat.py::test_packed_labels_only_on_assistant_tokens_within_a_document",),
    ),
    Mutation(
        "chat_prompts_trained",
        "chat SFT trains on the prompts and masks the answers",
        "titan_fold/data/chat.py",
        "pieces += [(full[done : len(prefix)], False), (full[len(prefix) : end], True)]",
        "pieces += [(full[done : len(prefix)], True), (full[len(prefix) : end], False)]",
        (
            "tests/test_chat.py::test_rendering_matches_transformers[chatml]",
            "tests/test_chat.py::test_rendering_matches_transformers[think]",
            "tests/test_chat.py::test_packed_labels_only_on_assistant_tokens_within_a_document",
        ),
    ),
    Mutation(
        "device_exchange_arrivals_off_by_one",
        "the device exchange groups its arrivals by expert one row off at each block's end",
        "titan_fold/moe/rows.py",
        "chunk = torch.searchsorted(ends, torch.arange(rows, device=blocks.device), right=True)",
        "chunk = torch.searchsorted(ends, torch.arange(rows, device=blocks.device), right=False)",
        ("tests/test_static_exchange.py::test_static_exchange_matches_exact_and_one_rank",),
    ),
    Mutation(
        "copies_water_fill_level_rounded_down",
        "the copies' water level rounded down: a level that cannot hold every nominee row",
        "titan_fold/moe/replicas.py",
        "(movable + base.sort().values.cumsum(0) + k - 1)",
        "(movable + base.sort().values.cumsum(0))",
        tuple(
            f"tests/test_hot_replicas.py::test_planner_matches_oracle[{p}]" for p in ("2-1", "3-1", "2-2", "4-1", "3-2")
        ),
    ),
    Mutation(
        "copies_water_fill_wrong_home",
        "the copies' water fill takes each nominee's rows off the wrong rank's load",
        "titan_fold/moe/replicas.py",
        "index_add(0, nominees // E_loc, moving)",
        "index_add(0, nominees % ep, moving)",
        tuple(
            f"tests/test_hot_replicas.py::test_planner_matches_oracle[{p}]" for p in ("2-1", "3-1", "2-2", "4-1", "3-2")
        ),
    ),
    Mutation(
        "copies_nominate_the_coldest",
        "the copies go to the least loaded experts, not the busiest",
        "titan_fold/moe/replicas.py",
        "return totals.topk(R).indices",
        "return (-totals).topk(R).indices",
        tuple(
            f"tests/test_hot_replicas.py::test_planner_matches_oracle[{p}]" for p in ("2-1", "3-1", "2-2", "4-1", "3-2")
        ),
    ),
    Mutation(
        "aux_free_load_not_reduced",
        "the aux-free bias follows each rank's own expert load, not the stage's (dp x cp x tp)",
        "titan_fold/trainer/fold_trainer.py",
        "group = stage_mesh.get_group() if stage_mesh is not None else None",
        "group = None",
        (
            "tests/test_equivalence_deepseek.py::test_deepseek_layout_matches_one_rank[cp2]",
            "tests/test_equivalence_deepseek.py::test_deepseek_layout_matches_one_rank[tp2]",
        ),
    ),
    Mutation(
        "dataloader_counts_one_ranks_sequences",
        "the dataloader's consumed sequences count one dp rank's, not the global batch",
        "titan_fold/data/dataloader.py",
        "step = self._batches.local_batch_size * self.dp_world_size",
        "step = self._batches.local_batch_size",
        ("tests/test_data.py::test_resume_with_another_dp_degree",),
    ),
    Mutation(
        "dataloader_resumes_from_the_start",
        "a resumed dataloader starts again at the stream's first sequence",
        "titan_fold/data/dataloader.py",
        "self._batches.start = self.consumed_sequences",
        "self._batches.start = 0",
        ("tests/test_data.py::test_resume_with_another_dp_degree",),
    ),
    Mutation(
        "lr_resume_step_behind",
        "a weights-only resume puts the lr schedule one step behind the saved step",
        "titan_fold/checkpoint/manager.py",
        "            scheduler.last_epoch = step\n",
        "            scheduler.last_epoch = step - 1\n",
        ("tests/test_checkpoint.py::test_extending_a_run_with_the_defaults_resumes_its_model_only_checkpoint",),
    ),
    Mutation(
        "lr_resume_schedule_one_step_ahead",
        "a resume sets the lr of the step after the loaded one's next",
        "titan_fold/checkpoint/manager.py",
        "lrs = [base * fn(scheduler.last_epoch) for",
        "lrs = [base * fn(scheduler.last_epoch + 1) for",
        (
            "tests/test_checkpoint.py::test_extending_a_run_with_the_defaults_resumes_its_model_only_checkpoint",
            "tests/test_checkpoint.py::test_a_resumed_run_takes_the_new_lr_schedule_from_its_first_step",
            "tests/test_lr_schedule.py::test_logged_lr_is_the_closed_form_through_a_short_warmup_and_a_resume",
        ),
    ),
    Mutation(
        "megatron_flops_noncausal",
        "Megatron's FLOP count takes every query against every key (its causal halving dropped)",
        "bench/flops.py",
        "q * seq_len / 2 * 2",
        "q * seq_len * 2",
        (
            "tests/test_flops.py::test_megatron_count_of_a_layer_by_hand",
            "tests/test_flops.py::test_published_per_token_counts",
        ),
        fast=True,
    ),
    Mutation(
        "full_depth_proxy_keeps_every_expert",
        "the full-depth proxy -E<m> keeps all the model's experts instead of one EP rank's m",
        "bench/train_step.py",
        'num_experts=changes["experts"]',
        "num_experts=args.moe.num_experts",
        ("tests/test_flops.py::test_one_ep_ranks_experts_keep_the_per_token_count",),
        fast=True,
    ),
    Mutation(
        "warmup_fit_one_short",
        "a warm-up longer than the run fitted to one step fewer than the run",
        "titan_fold/trainer/fold_trainer.py",
        "        config.lr_scheduler.warmup_steps = steps\n",
        "        config.lr_scheduler.warmup_steps = max(1, steps - 1)\n",
        ("tests/test_lr_schedule.py::test_logged_lr_is_the_closed_form_through_a_short_warmup_and_a_resume",),
    ),
    Mutation(
        "document_attention_positions_run_on",
        "packed documents' positions run on across the sample (RoPE sees only their differences)",
        "titan_fold/models/documents.py",
        "        return document_positions(document_ids), document_mask(document_ids, window=window)\n",
        "        return torch.arange(document_ids.shape[1]).expand_as(document_ids), document_mask(document_ids, window=window)\n",
        tuple(
            f"tests/test_documents.py::test_every_layer_gets_positions_that_restart_in_each_document[{name}]"
            for name in ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
        ),
        fast=True,
    ),
    Mutation(
        "mfu_full_causal_for_documents",
        "MFU counts a packed sample's attention as the whole sample's causal square",
        "titan_fold/trainer/fold_trainer.py",
        "        lengths = document_lengths(ids) if ids is not None else torch.full(labels.shape[:1], labels.shape[1])\n",
        "        lengths = torch.full(labels.shape[:1], labels.shape[1])\n",
        (
            *(
                f"tests/test_documents.py::test_mfu_counts_the_attention_within_each_document[{name}]"
                for name in ("qwen3_moe", "deepseek_v3")
            ),
            "tests/test_train.py::test_logged_flops_count_the_attention_within_each_packed_document",
        ),
    ),
    Mutation(
        "h100_pcie_given_the_sxm_peak",
        "an H100 PCIe's MFU divided by the H100 SXM's peak",
        "titan_fold/trainer/metrics.py",
        '    "NVIDIA H100 PCIe": 756e12,\n',
        '    "NVIDIA H100 PCIe": 989e12,\n',
        ("tests/test_bench.py::test_mfu_peak_comes_from_the_exact_device_name[H100-PCIe]",),
    ),
    Mutation(
        "mtp_loss_weight_not_passed",
        "mtp.loss_scaling_factor never reaches the model (its flavor's 0.1 stays)",
        "titan_fold/models/args.py",
        "            self.mtp_layers, self.mtp_loss_scaling_factor = mtp.num_layers, mtp.loss_scaling_factor\n",
        "            self.mtp_layers = mtp.num_layers\n",
        (
            "tests/test_keys_reach.py::test_the_key_changes_what_it_configures[mtp.loss_scaling_factor]",
            "tests/test_keys_reach.py::test_mtp_loss_weight_scales_the_mtp_layers_gradients",
        ),
        fast=True,
    ),
    Mutation(
        "moe_key_not_passed",
        "moe.routed_scaling_factor left out of the [moe] values the model takes",
        "titan_fold/models/args.py",
        "            moved = {f.name for f in dataclasses.fields(MovedMoEKeys)}",
        '            moved = {f.name for f in dataclasses.fields(MovedMoEKeys)} | {"routed_scaling_factor"}',
        ("tests/test_keys_reach.py::test_the_key_changes_what_it_configures[moe.routed_scaling_factor]",),
    ),
    Mutation(
        "moe_key_described_twice",
        "moe.stash_rows declared again on MoEArgs, with its own text and another default than [moe]'s",
        "titan_fold/moe/args.py",
        '    num_experts: int = 8\n    """Routed experts."""\n',
        '    num_experts: int = 8\n    """Routed experts."""\n    stash_rows: int = 1024\n    """Rows of the stash."""\n',
        ("tests/test_config.py::test_each_moe_key_is_described_once",),
    ),
    Mutation(
        "muon_ns_steps_not_passed",
        "optimizer.muon_ns_steps not passed to Muon (always 5 Newton-Schulz steps)",
        "titan_fold/trainer/muon.py",
        "        ns_steps=c.muon_ns_steps,\n",
        "        ns_steps=5,\n",
        ("tests/test_keys_reach.py::test_the_key_changes_what_it_configures[optimizer.muon_ns_steps]",),
    ),
    Mutation(
        "copies_of_the_coldest_experts",
        "the copies' planner nominates the least loaded experts: the busiest ep rank keeps its rows",
        "titan_fold/moe/replicas.py",
        "    return totals.topk(R).indices\n",
        "    return totals.topk(R, largest=False).indices\n",
        ("tests/test_hot_replicas_train.py::test_copies_lower_the_busiest_ep_ranks_rows",),
    ),
    Mutation(
        "expert_bias_zeroed_on_resume",
        "the aux-free router bias saved but zeroed once a checkpoint is loaded",
        "titan_fold/trainer/fold_trainer.py",
        "        check_weights(self.model_parts, where)\n",
        "        check_weights(self.model_parts, where)\n"
        "        from titan_fold.moe import moe_layers\n"
        "        [m.router.expert_bias.zero_() for m in moe_layers(self.model_parts)]\n",
        ("tests/test_checkpoint.py::test_resume_two_ranks_ep2_on_one_rank",),
    ),
    Mutation(
        "commit_subject_off_by_one",
        "the commit-msg hook refuses a subject of exactly 72 characters",
        ".ci/commit_subject.py",
        "    if len(subject) > LIMIT:",
        "    if len(subject) >= LIMIT:",
        ("tests/test_commit_subject.py::test_subject_length_limit",),
        fast=True,
    ),
    Mutation(
        "expert_bias_before_verdict",
        "the aux-free router bias updated before the guard's verdict is read: a skipped step moves it",
        "titan_fold/trainer/step.py",
        "            self.guard.after_optimizer_step()\n"
        "            if self.expert_bias_update is not None:\n"
        "                self.expert_bias_update()\n",
        "            if self.expert_bias_update is not None:\n"
        "                self.expert_bias_update()\n"
        "            self.guard.after_optimizer_step()\n",
        ("tests/test_optimizer.py::test_skipped_step_moves_neither_router_bias_nor_lr",),
    ),
    Mutation(
        "policy_loss_per_micro_batch",
        "the loss of each micro-batch divided by its own labelled tokens, not the global batch's",
        "titan_fold/trainer/step.py",
        "                loss = self.loss_fn(pred, labels) / global_valid_tokens\n",
        "                loss = self.loss_fn(pred, labels) / (labels[..., 0] != IGNORE_INDEX).sum()\n",
        ("tests/test_policy.py::test_step_matches_one_rank_under_dp2_micro_batches_cp2_pp2",),
    ),
    Mutation(
        "policy_ratio_max_summed_over_ranks",
        "the logged largest ratio summed over the ranks instead of their max",
        "titan_fold/trainer/metrics.py",
        "            dist.all_reduce(top, op=dist.ReduceOp.MAX)\n",
        "            dist.all_reduce(top)\n",
        ("tests/test_policy.py::test_step_matches_one_rank_under_dp2_micro_batches_cp2_pp2",),
    ),
    Mutation(
        "policy_clip_bounds_swapped",
        "the ratio clipped to [1 - clip_high, 1 + clip_low]",
        "titan_fold/trainer/policy.py",
        "torch.clamp(policy_ratio, 1 - self.clip_low, 1 + self.clip_high)",
        "torch.clamp(policy_ratio, 1 - self.clip_high, 1 + self.clip_low)",
        ("tests/test_policy.py::test_objective_matches_float64_reference[0.0]",),
    ),
    Mutation(
        "policy_clip_low_both_sides",
        "the upper clip taken at 1 + clip_low (no clip-higher)",
        "titan_fold/trainer/policy.py",
        "torch.clamp(policy_ratio, 1 - self.clip_low, 1 + self.clip_high)",
        "torch.clamp(policy_ratio, 1 - self.clip_low, 1 + self.clip_low)",
        ("tests/test_policy.py::test_objective_matches_float64_reference[0.0]",),
    ),
    Mutation(
        "policy_mask_ignored",
        "the policy loss summed over every token, the unlabelled ones too",
        "titan_fold/trainer/policy.py",
        "        return torch.where(mask, term, 0.0).sum()\n",
        "        return term.sum()\n",
        ("tests/test_policy.py::test_objective_matches_float64_reference[0.0]",),
    ),
    Mutation(
        "policy_tis_ratio_against_behaviour",
        "with truncated importance sampling, the clipped ratio still taken against the behaviour policy",
        "titan_fold/trainer/policy.py",
        "policy_ratio = torch.exp(logp - logp.detach()) if self.tis_cap > 0 else ratio",
        "policy_ratio = ratio",
        ("tests/test_policy.py::test_objective_matches_float64_reference[1.1]",),
    ),
    Mutation(
        "api_recorded_routing_ignored",
        "the API's train_step records its own routing instead of the logprobs pass's (R2)",
        "titan_fold/api.py",
        "        if self._recorded is not None and _same_batch(self._recorded[0], packed):",
        "        if self._recorded is not None and not _same_batch(self._recorded[0], packed):",
        ("tests/test_api.py::test_recorded_replay_takes_the_logprobs_pass_routing",),
    ),
    Mutation(
        "policy_tis_weight_not_detached",
        "the truncated importance weight differentiated through the trainer's log-probability",
        "titan_fold/trainer/policy.py",
        "torch.clamp(torch.exp(log_ratio.detach()), max=self.tis_cap)",
        "torch.clamp(torch.exp(log_ratio), max=self.tis_cap)",
        ("tests/test_policy.py::test_objective_matches_float64_reference[1.1]",),
    ),
    Mutation(
        "rollout_logprobs_on_the_input_token",
        "each behaviour log-probability packed at its own token's position, not its label's",
        "titan_fold/data/rollouts.py",
        "        TokenField(LOGPROBS_KEY, 1, np.zeros((), np.float32)),\n",
        "        TokenField(LOGPROBS_KEY, 0, np.zeros((), np.float32)),\n",
        ("tests/test_rollouts.py::test_fields_follow_their_tokens_through_packing",),
    ),
    Mutation(
        "rollout_repeated_experts_accepted",
        "a token's routing that repeats an expert within its k accepted",
        "titan_fold/data/rollouts.py",
        "    if repeated.any():\n",
        "    if False:\n",
        ("tests/test_rollouts.py::test_each_malformed_record_is_refused_in_one_line",),
    ),
    Mutation(
        "stream_gathers_every_layer",
        "the weight stream keeps every gathered group alive: the whole model gathered at once",
        "titan_fold/checkpoint/stream.py",
        "                del native\n",
        "                self.held = [*getattr(self, 'held', []), native]\n",
        tuple(
            f"tests/test_stream.py::test_stream_equals_the_hf_export[{layout}]"
            for layout in ("pp2_dp2_ep2", "tp2_dp2_ep2_etp2")
        ),
    ),
    Mutation(
        "stream_skips_later_stages",
        "the weight stream plans the first pipeline stage's groups only",
        "titan_fold/checkpoint/stream.py",
        "        for stage, groups in enumerate(stages):\n",
        "        for stage, groups in enumerate(stages[:1]):\n",
        ("tests/test_stream.py::test_stream_equals_the_hf_export[pp2_dp2_ep2]",),
    ),
    Mutation(
        "logprobs_one_position_off",
        "the API's log-probs read each token's log-prob from the logits at its own position",
        "titan_fold/api.py",
        "                rows.append(lp[:, :-1].gather(-1, inputs[:, 1:, None]).squeeze(-1).cpu())\n",
        "                rows.append(lp[:, 1:].gather(-1, inputs[:, 1:, None]).squeeze(-1).cpu())\n",
        ("tests/test_api.py::test_api_at_one_rank",),
    ),
    Mutation(
        "replay_ids_one_layer_off",
        "routing replay: each MoE layer reads the ids of the layer before it",
        "titan_fold/models/transformer.py",
        "routed_experts[:, :, index]",
        "routed_experts[:, :, index - 1]",
        (
            "tests/test_routing_replay.py::test_replaying_the_routers_choice_equals_off[softmax_aux_loss]",
            "tests/test_routing_replay.py::test_replaying_the_routers_choice_equals_off[sigmoid_norm_scaled_aux_free]",
        ),
    ),
    Mutation(
        "mtp_inputs_are_labels",
        "the MTP layers read the labels as their input tokens (a response's prompt embedded as token 0)",
        "titan_fold/models/mtp.py",
        "    ahead = torch.cat([inputs[:, 1:], labels[:, -1:]], dim=1)",
        "    ahead = labels",
        ("tests/test_policy.py::test_policy_step_with_mtp_and_replay_against_float64_reference",),
    ),
    Mutation(
        "mtp_targets_unmasked",
        "the MTP layers trained on every token ahead, the prompts' too, not the labelled ones",
        "titan_fold/models/mtp.py",
        "shifted(labels, k + 1)], dim=-1)",
        "shifted(ahead, k + 1)], dim=-1)",
        ("tests/test_policy.py::test_policy_step_with_mtp_and_replay_against_float64_reference",),
    ),
    Mutation(
        "mtp_scaled_by_all_tokens",
        "the MTP loss divided by the micro-batch's tokens, not the step's labelled tokens",
        "titan_fold/trainer/step.py",
        "(1.0 / torch.as_tensor(global_valid_tokens, dtype=torch.float32))",
        "(1.0 / torch.as_tensor(labels.numel(), dtype=torch.float32))",
        ("tests/test_policy.py::test_policy_step_with_mtp_and_replay_against_float64_reference",),
    ),
    Mutation(
        "record_pass_runs_mtp",
        "routing replay's R2 record pass runs the MTP layers: their loss and MoE statistics counted twice",
        "titan_fold/trainer/step.py",
        "self.model_parts[0](inputs, **extra_inputs, **without_mtp(extra_kwargs))",
        "self.model_parts[0](inputs, **extra_inputs, **extra_kwargs)",
        ("tests/test_routing_replay.py::test_recorded_step_with_mtp_routes_its_layers_by_their_routers",),
    ),
    Mutation(
        "replay_ids_not_split_under_cp",
        "routing replay under cp: the ids of the first s / cp tokens, not of the rank's two chunks",
        "titan_fold/moe/replay.py",
        "        routed = routed.index_select(1, cp_index)\n",
        "        routed = routed[:, : cp_index.numel()]\n",
        ("tests/test_routing_replay.py::test_the_trainer_splits_the_ids_as_the_tokens[causal]",),
    ),
    Mutation(
        "replay_recompute_reroutes",
        "routing replay under activation checkpointing: the recompute routes by the router's choice",
        "titan_fold/models/transformer.py",
        "        replayed = None if routed_experts is None or index is None else",
        "        replayed = None if routed_experts is None or index is None or torch._C._current_graph_task_id() != -1 else",
        ("tests/test_routing_replay.py::test_recompute_replays_the_same_experts",),
    ),
    Mutation(
        "replay_combine_weights_of_own_choice",
        "routing replay: the combine weights are the scores at the router's own choice",
        "titan_fold/moe/router.py",
        "        experts = torch.where(given, replayed, experts)\n    probs = scores.gather(-1, experts)  # [T, k]\n",
        "        own, experts = experts, torch.where(given, replayed, experts)\n"
        "    probs = scores.gather(-1, own if replayed is not None else experts)\n",
        (
            "tests/test_routing_replay.py::test_replayed_layer_against_float64_reference[softmax_aux_loss]",
            "tests/test_routing_replay.py::test_replayed_layer_against_float64_reference[sigmoid_norm_scaled_aux_free]",
        ),
    ),
    Mutation(
        "upcycle_into_clamped_experts",
        "upcycling copies a plain SwiGLU FFN into GPT-OSS's clamped, biased experts",
        "titan_fold/checkpoint/upcycle.py",
        "    if moe.activation != ExpertActivation() or moe.expert_biases:\n",
        "    if False:\n",
        ("tests/test_upcycle.py::test_refuses_experts_no_dense_model_has",),
        fast=True,
    ),
    Mutation(
        "gdn_fake_tensors_step_the_chunk_loop",
        "on fake tensors the GDN rule runs its chunk loop op by op, not as one op",
        "titan_fold/models/gated_deltanet.py",
        "    if not torch.compiler.is_compiling() and is_fake(q):\n",
        "    if False:\n",
        ("tests/test_gated_deltanet.py::test_fake_tensors_take_the_rule_as_one_op",),
    ),
    Mutation(
        "gdn_op_backward_swaps_decay_and_beta",
        "the GDN op's backward differentiates the rule with the decay and beta swapped",
        "titan_fold/models/gated_deltanet.py",
        "    _, vjp = torch.func.vjp(rule, q, k, v, g, beta)\n",
        "    _, vjp = torch.func.vjp(rule, q, k, v, beta, g)\n",
        ("tests/test_gated_deltanet.py::test_fake_tensors_take_the_rule_as_one_op",),
    ),
    Mutation(
        "torchtitan_formula_one_head_width",
        "torchtitan's MoE formula on our model counts attention over head_dim, not q.k plus v",
        "bench/vs_torchtitan.py",
        "get_moe_model_nparams_and_flops(args, model, 2 * ours.head_dim, seq_len)",
        "get_moe_model_nparams_and_flops(args, model, ours.head_dim, seq_len)",
        ("tests/test_flops.py::test_torchtitan_formula_on_our_gpt_oss_equals_its_own_model",),
        fast=True,
    ),
    Mutation(
        "gdn_state_not_reset",
        "the Gated DeltaNet state carried over a document start inside a packed sample",
        "titan_fold/models/gated_deltanet.py",
        "    start = F.pad(starts, (0, pad)).view(b, 1, n, chunk)\n",
        "    start = torch.zeros_like(F.pad(starts, (0, pad))).view(b, 1, n, chunk)\n",
        (
            "tests/test_gated_deltanet.py::test_chunked_rule_equals_the_recurrent_definition_in_float64",
            "tests/test_gated_deltanet.py::test_layer_on_packed_documents_equals_transformers_document_by_document"
            "[qwen3_5_moe]",
        ),
    ),
    Mutation(
        "gated_norm_sigmoid_gate",
        "the Gated DeltaNet output's RMSNorm gated by sigmoid(z) instead of silu(z)",
        "titan_fold/models/gated_deltanet.py",
        "        return (normed * F.silu(z.float())).to(o.dtype)\n",
        "        return (normed * torch.sigmoid(z.float())).to(o.dtype)\n",
        (
            "tests/test_gated_deltanet.py::test_layer_on_packed_documents_equals_transformers_document_by_document"
            "[qwen3_next]",
        ),
    ),
    Mutation(
        "sink_dropped_from_the_softmax",
        "the attention sinks left out of each query's softmax",
        "titan_fold/models/attention.py",
        "    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]\n",
        "    probs = scores.softmax(dim=-1)\n",
        (
            "tests/test_variants.py::test_attend_window_and_sinks_limits",
            "tests/test_gpt_oss.py::test_logits_and_loss_gradient_match_transformers",
        ),
    ),
    Mutation(
        "window_off_by_one",
        "a sliding-window query sees window + 1 keys (itself and window earlier ones)",
        "titan_fold/models/attention.py",
        "    return allowed if window is None else allowed & (delta < window)\n",
        "    return allowed if window is None else allowed & (delta <= window)\n",
        (
            "tests/test_variants.py::test_attend_window_and_sinks_limits",
            "tests/test_gpt_oss.py::test_logits_and_loss_gradient_match_transformers",
        ),
    ),
    Mutation(
        "document_window_off_by_one",
        "a sliding-window query of a packed document sees window + 1 keys",
        "titan_fold/models/documents.py",
        "        allowed = allowed & (delta < window)\n",
        "        allowed = allowed & (delta <= window)\n",
        ("tests/test_gpt_oss.py::test_packed_documents_match_each_document_alone",),
    ),
    Mutation(
        "expert_bias_added_on_every_etp_rank",
        "each etp rank adds the experts' w2 bias to its partial sum: the bias counted etp times",
        "titan_fold/parallel/experts.py",
        "        moe.experts.adds_w2_bias = etp_rank == 0  # the etp sum gets w2_bias once\n",
        "        moe.experts.adds_w2_bias = True\n",
        ("tests/test_equivalence_gpt_oss.py::test_gpt_oss_layout_matches_one_rank[tp2_cp2_dp2_ep2_etp2]",),
    ),
    Mutation(
        "sliding_layers_counted_as_full",
        "MFU and the planner count a sliding-window layer's attention as full causal attention",
        "titan_fold/models/args.py",
        "        window = self.layer_window(layer_id)\n",
        "        window = None\n",
        ("tests/test_variants.py::test_sliding_layers_count_their_window_in_the_flops",),
        fast=True,
    ),
    Mutation(
        "crashed_rank_unnamed",
        "a rank that a signal ended leaves no line and no stacks in the launch's stderr",
        "tests/launcher.py",
        "    _report_signals(request, exit_codes)\n",
        "",
        ("tests/test_launcher.py::test_crashed_rank_is_named_with_its_stack",),
    ),
    Mutation(
        "clamp_limit_ignored",
        "GPT-OSS's SwiGLU without its clamp: gate and up pass the limit",
        "titan_fold/moe/activation.py",
        "    gate = gate.clamp(max=limit)\n    up = up.clamp(min=-limit, max=limit)\n",
        "",
        (
            "tests/test_variants.py::test_clamped_swiglu_with_biases_every_path[True-torch]",
            "tests/test_gpt_oss.py::test_logits_and_loss_gradient_match_transformers",
        ),
    ),
    Mutation(
        "private_call_outside_compat",
        "a private torch call (torch._check) inlined in a layer instead of taken from compat",
        "titan_fold/moe/counts.py",
        "    check(n >= 0)\n",
        "    torch._check(n >= 0)\n",
        ("tests/test_compat.py::test_private_names_are_used_from_compat_only",),
        fast=True,
    ),
    Mutation(
        "key_table_names_a_file_that_does_not_read",
        "comm.trace_buf_size listed as read by torchtitan's distributed utils, which names it but is not run",
        "titan_fold/common/torchtitan_keys.py",
        '        "debug.deterministic_warn_only",\n    ),\n    "titan_fold/trainer/world.py": (\n        "comm.init_timeout_seconds",\n        "comm.trace_buf_size",\n',
        '        "debug.deterministic_warn_only",\n        "comm.trace_buf_size",\n    ),\n    "titan_fold/trainer/world.py": (\n        "comm.init_timeout_seconds",\n',
        ("tests/test_torchtitan_keys.py::test_read_keys_are_read_where_the_table_says",),
    ),
    Mutation(
        "moved_overlap_flag_drops_the_split",
        'moe.overlap_ep_comm = true read as ep_overlap = "batch" beside delay_wgrad_compute = true: the split lost',
        "titan_fold/common/rules.py",
        '{"off": "batch", "wgrad": "batch_wgrad"}',
        '{"off": "batch", "wgrad": "batch"}',
        ("tests/test_config.py::test_moved_speed_keys_read_as_choices[both]",),
    ),
    Mutation(
        "limits_refuse_without_the_feature",
        "a feature's limits refuse their settings where the feature is off (moe.stash_rows = 0 refused beside "
        "moe.exchange = 'auto')",
        "titan_fold/common/rules.py",
        "return lambda c: self.on(c) and is_set(c)",
        "return lambda c: is_set(c)",
        ("tests/test_rules.py::test_default_config_breaks_no_rule",),
    ),
    Mutation(
        "one_of_names_the_pair_backwards",
        "settings that are one decision name the later one first (optimizer.master_weights = true with "
        "optimizer.name = 'Muon')",
        "titan_fold/common/rules.py",
        'f"{first} with {second}: {self.why}"',
        'f"{second} with {first}: {self.why}"',
        ("tests/test_rules.py::test_rule_met_first[optimizer.name = 'Muon' with optimizer.master]",),
    ),
    Mutation(
        "limits_name_their_first_setting",
        "a feature's limits always name the first setting it is refused with, not the one that is set",
        "titan_fold/common/rules.py",
        'f"{self.feature} with {setting}: {self.runs_with}"',
        'f"{self.feature} with {self.refused[0][0]}: {self.runs_with}"',
        ("tests/test_rules.py::test_rule_met_first[moe.hot_expert_replicas = 2 with moe.capacity]",),
    ),
)


def mutate(mutation: Mutation, root: Path) -> None:
    """Plant `mutation` in the copy of the repository at `root`."""
    path = root / mutation.path
    text = path.read_text()
    found = text.count(mutation.old)
    if found != 1:
        raise ValueError(f"mutation {mutation.name}: its text occurs {found} times in {mutation.path}, not once")
    path.write_text(text.replace(mutation.old, mutation.new))


@dataclasses.dataclass
class Tests:
    """One pytest run's verdict on each test it was given."""

    verdicts: dict[str, str]  # node id -> "passed" | "assertion: ..." | "crash: ..." | "timeout ..." | ...
    seconds: dict[str, float]  # node id -> setup + call + teardown
    output: str  # pytest's


def run_tests(root: Path, tests: list[str], timeout: float) -> Tests:
    """Run `tests` in the repository at `root` with the outcomes plugin: each test's verdict, a
    collection error for those pytest did not run, a timeout for all past `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="outcomes_") as tmp:
        outcomes = Path(tmp, "outcomes.json")
        paths = [str(root), str(PLUGIN), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "TITAN_FOLD_OUTCOMES": str(outcomes)}
        command = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-p", "pytest_outcomes"]
        # its own session: a timeout ends pytest, its ranks' zygote and every process the tests started
        proc = subprocess.Popen(
            [*command, "-n", "0", *tests],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return Tests({t: f"timeout: still running after {timeout:.0f} s" for t in tests}, {}, output)
        report = json.loads(outcomes.read_text()) if outcomes.exists() else {"tests": {}, "collection errors": []}
    last = output.strip().splitlines()[-1:] or [""]
    errors = report["collection errors"] or [f"pytest exited {proc.returncode}: {last[0]}"]
    verdicts = {
        t: report["tests"][t]["verdict"] if t in report["tests"] else f"collection error: {'; '.join(errors)[:300]}"
        for t in tests
    }
    return Tests(verdicts, {t: v["seconds"] for t, v in report["tests"].items()}, output)


@dataclasses.dataclass
class Outcome:
    mutation: Mutation
    verdict: str  # "caught" | "not caught: <why>" | "baseline fails: <why>"
    verdicts: dict[str, str]  # each named test's with the mutation ({} when it was not planted)
    seconds: float
    output: str  # pytest's, with the mutation (the baseline's when that failed)

    @property
    def caught(self) -> bool:
        return self.verdict == "caught"


def judge(mutation: Mutation, verdicts: dict[str, str]) -> str:
    """Caught when every named test failed on a test's assertion; else the first reason not."""
    for test in mutation.tests:
        if not verdicts[test].startswith("assertion"):
            return f"not caught: {verdicts[test]} ({test})"
    return "caught"


def run(
    mutations: list[Mutation], root: Path = ROOT, baseline: bool = True, timeout: float | None = None, echo=None
) -> list[Outcome]:
    """Each mutation planted in a fresh copy of the repository at `root` and its tests run there,
    after one baseline run of all their tests in an unmutated copy (`baseline`). A mutation's
    run times out after `timeout` seconds, by default 300 plus three times its tests' baseline."""
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="mutations_") as tmp:
        clean: Tests | None = None
        if baseline:
            copy = Path(tmp, "baseline")
            shutil.copytree(root, copy, ignore=IGNORED)
            named = list(dict.fromkeys(t for m in mutations for t in m.tests))
            clean = run_tests(copy, named, 3600)
            shutil.rmtree(copy)
        for m in mutations:
            start = time.perf_counter()
            if clean is not None:
                failing = [t for t in m.tests if clean.verdicts[t] != "passed"]
                if failing:
                    why = f"baseline fails: {clean.verdicts[failing[0]]} ({failing[0]})"
                    outcomes.append(Outcome(m, why, {}, 0.0, clean.output))
                    continue
            limit = timeout or (300 + 3 * sum(clean.seconds.get(t, 0.0) for t in m.tests) if clean else 3600)
            copy = Path(tmp, m.name)
            shutil.copytree(root, copy, ignore=IGNORED)
            try:
                mutate(m, copy)
            except ValueError as e:
                outcomes.append(Outcome(m, f"not caught: not planted: {e}", {}, 0.0, ""))
                continue
            got = run_tests(copy, list(m.tests), limit)
            shutil.rmtree(copy)
            outcomes.append(Outcome(m, judge(m, got.verdicts), got.verdicts, time.perf_counter() - start, got.output))
            if echo:
                echo(outcomes[-1])
    return outcomes


def read_record() -> dict:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {"mutations": {}}


def write_record(outcomes: list[Outcome]) -> None:
    """The outcomes into the record, the entries of mutations not run kept, of those gone dropped."""
    import torch

    known = {m.name for m in MUTATIONS}
    entries = {name: e for name, e in read_record()["mutations"].items() if name in known}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    for o in outcomes:
        entries[o.mutation.name] = {
            "fingerprint": o.mutation.fingerprint(),
            "verdict": o.verdict,
            "tests": o.verdicts,
            "seconds": round(o.seconds, 1),
            "recorded": f"{date}, torch {torch.__version__}, python {sys.version.split()[0]}",
        }
    entries = {m.name: entries[m.name] for m in MUTATIONS if m.name in entries}  # in the list's order
    fresh = {m.name for m in MUTATIONS if entries.get(m.name, {}).get("fingerprint") == m.fingerprint()}
    caught = sum(e.get("verdict") == "caught" for name, e in entries.items() if name in fresh)
    record = {"caught": caught, "of": len(MUTATIONS), "mutations": entries}
    RECORD.write_text(json.dumps(record, indent=1) + "\n")


def problems(record: dict) -> dict[str, str]:
    """What `--check` reports: each mutation whose entry is missing, stale or not caught -> why."""
    found = {}
    for m in MUTATIONS:
        seen = record["mutations"].get(m.name)
        if seen is None:
            found[m.name] = "not recorded"
        elif seen["fingerprint"] != m.fingerprint():
            found[m.name] = "stale (the mutation or its test files changed since it was recorded)"
        elif seen["verdict"] != "caught":
            found[m.name] = seen["verdict"]
    return found


def listing() -> str:
    """Each mutation, what it plants where, the tests that must catch it and the recorded outcome."""
    record = read_record()
    lines = [
        f"{len(MUTATIONS)} mutations ({sum(m.fast for m in MUTATIONS)} also run by the CPU suite: CI); "
        f"{record.get('caught', 0)} caught on a test's assertion, as recorded by `python -m tests.mutations --record`"
    ]
    for m in MUTATIONS:
        seen = record["mutations"].get(m.name)
        if seen is None or seen["fingerprint"] != m.fingerprint():
            outcome = "not recorded since it or its tests last changed"
        else:
            outcome = f"caught ({seen['seconds']:.0f} s)" if seen["verdict"] == "caught" else seen["verdict"]
        lines += [
            "",
            f"{m.name}{'  [CI]' if m.fast else ''}: {m.what}",
            f"  in {m.path}; {outcome}; must fail:",
            *(f"    {t}" for t in m.tests),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the list with the recorded outcomes")
    parser.add_argument(
        "--check", action="store_true", help="list the entries stale, missing or not caught; exit 1 if any"
    )
    parser.add_argument("--record", action="store_true", help=f"write the outcomes to {RECORD.relative_to(ROOT)}")
    parser.add_argument("--fast", action="store_true", help="only those the CPU suite runs")
    parser.add_argument(
        "--stale", action="store_true", help="only those --check reports (--record --stale refreshes them)"
    )
    parser.add_argument("--timeout", type=float, help="seconds per mutation (default: 300 + 3 x its baseline)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    if args.check:
        found = problems(read_record())
        print("".join(f"{name}: {why}\n" for name, why in found.items()), end="")
        if not found:
            print(f"the record is current: {len(MUTATIONS)} mutations, every one caught")
        return 1 if found else 0
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"no mutation {', '.join(unknown)}; one of {', '.join(known)}")
    stale = problems(read_record()) if args.stale else {}
    chosen = [known[n] for n in args.names] or [
        m for m in MUTATIONS if (m.fast or not args.fast) and (m.name in stale or not args.stale)
    ]
    if not chosen:  # pytest given no test would run the whole suite
        print("no mutation to run")
        return 0

    def echo(o: Outcome) -> None:
        print(f"{o.verdict}  {o.mutation.name}  ({o.seconds:.0f} s)", flush=True)
        if not o.caught:
            print("".join(f"  {test}: {verdict}\n" for test, verdict in o.verdicts.items()), end="", flush=True)
        if args.verbose:
            print(o.output, flush=True)

    outcomes = run(chosen, timeout=args.timeout, echo=echo)
    for o in outcomes:
        if o.verdict.startswith("baseline") or o.verdict.startswith("not caught: not planted"):
            echo(o)
    missed = [o.mutation.name for o in outcomes if not o.caught]
    print(
        f"{len(chosen) - len(missed)} of {len(chosen)} mutations caught"
        + (f"; not caught: {', '.join(missed)}" if missed else "")
    )
    if args.record:
        write_record(outcomes)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
