"""Per-GPU memory of DeepSeek-V3 671B on 1024 GPUs by titan_fold's cost model (titan_fold/cost_model.py),
beside Megatron-Core's published figures (docs/planning.md quotes this output; `python docs/gen.py`
regenerates it).

Mappings: the one `python -m titan_fold.plan` ranks first for 80 GiB GPUs (deepseek_v3_671b.toml),
and a Megatron-Core-like one (pp 16, tp 1, cp 1, ep 64, no recompute). "prob after w2" adds what
keeping each routed row's w2 output would cost (the combine weight applied after w2, so its
gradient needs that output): the saving of memory-efficient permutation.
"""

from titan_fold.models import FLAVORS
from titan_fold.planning.cost_model import GIB, Mapping, Workload, _layers_per_stage, memory, routed_rows
from titan_fold.planning.sizes import model_sizes

sizes = model_sizes(FLAVORS["deepseek_v3"]["671B"], 4096, "deepseek_v3/671B")
work = Workload(seq_len=4096, global_batch=8192)
MAPPINGS = {
    "planner's pick (pp4 dp32 cp2 tp4 | ep32 edp8, selective AC)": Mapping(4, 1, 32, 2, 4, 32, 1, 8, "selective"),
    "Megatron-Core-like (pp16 dp64 cp1 tp1 | ep64 edp1, no recompute)": Mapping(16, 1, 64, 1, 1, 64, 1, 1, "none"),
}
print(
    f"{'GiB per GPU':<66} {'states':>7} {'unsharded':>9} {'activations':>11} {'other':>6} {'total':>6} "
    f"{'prob after w2':>13}"
)
for name, m in MAPPINGS.items():
    mem = memory(sizes, m, work)
    states = mem.params + mem.grads + mem.optimizer
    other = mem.backward + mem.dispatcher + mem.logits
    # w2's output [routed rows, dim] kept per MoE layer and micro-batch in flight (first stage)
    in_flight = min(m.pp, work.microbatches(m.dp))
    rows = routed_rows(sizes, m, work) * m.etp
    after_w2 = work.compute_bytes * sizes.dim * rows * _layers_per_stage(sizes, m.pp)["moe"] * in_flight
    if m.recompute == "full":
        after_w2 = 0.0
    print(
        f"{name:<66} {states / GIB:7.1f} {mem.unsharded / GIB:9.1f} {mem.activations / GIB:11.1f} "
        f"{other / GIB:6.1f} {mem.total / GIB:6.1f} {'+' + format(after_w2 / GIB, '.1f'):>13}"
    )
print(
    f"Megatron-Core, reported: 199.5 GB = {199.5e9 / GIB:.1f} GiB per GPU, activations ~131 GB = "
    f"{131e9 / GIB:.1f} GiB, memory-efficient permutation saves ~26.3 GB = {26.3e9 / GIB:.1f} GiB"
)
