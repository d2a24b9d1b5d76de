"""Planted bugs that the tests must catch: `python -m tests.mutations [NAME ...]`.

Each mutation replaces one piece of text (found exactly once) in a copy of the repository and
runs the tests named for it there, with the copy first on the import path; the mutation is
caught when every one of those tests fails (reported FAILED, not a collection error). The
unmutated suite passes the same tests, so each catch is the bug's doing.

`--record` writes the outcome of the run to tests/data/mutation_results.json with each
mutation's fingerprint; `--list` prints the list with those outcomes (docs/running.md quotes
it). tests/test_mutations.py checks that the record covers the list as it is, every
mutation caught, and runs the ones marked `fast` again in the CPU suite.
"""

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "tests" / "data" / "mutation_results.json"
# what a copy leaves out: history, environments, outputs and caches
IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "outputs", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info"
)


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in a phrase
    path: str  # the file it is planted in, from the repository's root
    old: str  # text found exactly once in that file
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail
    fast: bool = False  # run by the CPU suite (tests/test_mutations.py)

    def fingerprint(self) -> str:
        """Changes with anything that defines the mutation (a record of another one is stale)."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


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
        "titan_fold/moe/dispatcher.py",
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
        "        pad = torch.full_like(labels[:, :j], IGNORE_INDEX)\n        columns.append(torch.cat([labels[:, j:], pad], dim=1))\n",
        "        pad = torch.full_like(labels[:, :j + 1], IGNORE_INDEX)\n        columns.append(torch.cat([labels[:, j + 1:], pad], dim=1))\n",
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
        "titan_fold/moe/dispatcher.py",
        "            expert_of_row = torch.searchsorted(ends, within, right=True).flatten()  # [R_all], E_loc = padding\n",
        "            expert_of_row = torch.searchsorted(ends, within, right=True).clamp(max=E_loc - 1).flatten()\n",
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
        "        return document_positions(document_ids), document_mask(document_ids)\n",
        "        return torch.arange(document_ids.shape[1]).expand_as(document_ids), document_mask(document_ids)\n",
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
        'f.name not in (*MOVED_MOE_KEYS, "token_drop")',
        'f.name not in (*MOVED_MOE_KEYS, "token_drop", "routed_scaling_factor")',
        ("tests/test_keys_reach.py::test_the_key_changes_what_it_configures[moe.routed_scaling_factor]",),
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
class Outcome:
    mutation: Mutation
    failed: list[str]  # the named tests that failed
    seconds: float
    output: str  # pytest's

    @property
    def caught(self) -> bool:
        return sorted(self.failed) == sorted(self.mutation.tests)


def run(mutation: Mutation, workers: int = 0) -> Outcome:
    """Plant `mutation` in a fresh copy of the repository and run its tests there."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutation_{mutation.name}_") as tmp:
        root = Path(tmp, "repo")
        shutil.copytree(ROOT, root, ignore=IGNORED)
        mutate(mutation, root)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        # -rf: a line "FAILED <node id> - <message>" per failed test
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-rf",
                "-p",
                "no:cacheprovider",
                "-n",
                str(workers),
                *mutation.tests,
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
        )
    output = r.stdout + r.stderr
    failed = [line.split()[1] for line in output.splitlines() if line.startswith("FAILED ")]
    return Outcome(mutation, [t for t in mutation.tests if t in failed], time.perf_counter() - start, output)


def write_record(outcomes: list[Outcome], command: list[str]) -> None:
    import torch

    record = {
        "command": " ".join(["python -m tests.mutations", *command]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "mutations": {
            o.mutation.name: {
                "fingerprint": o.mutation.fingerprint(),
                "caught": o.caught,
                "failed": o.failed,
                "seconds": round(o.seconds, 1),
            }
            for o in outcomes
        },
    }
    RECORD.write_text(json.dumps(record, indent=1) + "\n")


def read_record() -> dict:
    return json.loads(RECORD.read_text())


def listing() -> str:
    """Each mutation, what it plants where, the tests that must catch it and the recorded outcome."""
    record = read_record()
    lines = [
        f"{len(MUTATIONS)} mutations ({sum(m.fast for m in MUTATIONS)} also run by the CPU suite: CI); "
        f"outcomes as recorded by `{record['command']}` ({record['date']}, torch {record['torch']})"
    ]
    for m in MUTATIONS:
        seen = record["mutations"].get(m.name)
        if seen is None or seen["fingerprint"] != m.fingerprint():
            outcome = "not recorded since it last changed"
        else:
            outcome = f"caught ({seen['seconds']:.0f} s)" if seen["caught"] else "MISSED"
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
    parser.add_argument("--record", action="store_true", help=f"write the outcomes to {RECORD.relative_to(ROOT)}")
    parser.add_argument("--fast", action="store_true", help="only those the CPU suite runs")
    parser.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers per mutation")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    if args.record and (args.names or args.fast):
        parser.error("--record: the record is of the whole list; run it without names or --fast")
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"no mutation {', '.join(unknown)}; one of {', '.join(known)}")
    chosen = [known[n] for n in args.names] or [m for m in MUTATIONS if m.fast or not args.fast]
    missed, outcomes = [], []
    for m in chosen:
        outcome = run(m, args.workers)
        outcomes.append(outcome)
        print(f"{'caught' if outcome.caught else 'MISSED'}  {m.name}  ({outcome.seconds:.0f} s)", flush=True)
        if args.verbose:
            print(outcome.output, flush=True)
        if not outcome.caught:
            missed.append(m.name)
            for test in m.tests:
                if test not in outcome.failed:
                    print(f"  did not fail: {test}", flush=True)
    print(
        f"{len(chosen) - len(missed)} of {len(chosen)} mutations caught"
        + (f"; missed: {', '.join(missed)}" if missed else "")
    )
    if args.record:
        write_record(outcomes, argv if argv is not None else sys.argv[1:])
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
