"""Folding planner: memory, communication and a roofline step time for every parallel mapping.

Pure functions over data classes; search.py ranks mappings with them, `titan_fold.plan` is the command line. The model is the
titan_fold trainer as it runs (FSDP2 over dp_shard x cp for dense parameters and over edp for
experts, a 1F1B pipeline schedule (torch.distributed.pipelining's, as the trainer runs it),
sequence parallel whenever tp > 1, the EP x ETP dispatcher of docs/moe.md), with these
simplifications (docs/planning.md lists them again):

- micro-batches of `micro_batch` sequences (the search uses 1): m = global_batch / (dp x micro_batch);
- bf16 compute, fp32 master weights, fp32 gradients, two fp32 AdamW moments: 16 bytes per
  sharded parameter, plus the unsharded bf16 copies FSDP2 gathers;
- activations counted tensor by tensor for one block (see `activation_bytes`); flash attention
  (no score matrix), the log-sum-exp kept in fp32;
- communication volumes are bytes each rank sends, ring algorithms ((n-1)/n of the gathered
  size), all-to-all ((ep-1)/ep of the routed tokens leave the rank); a group that spans two
  nodes runs at the inter-node bandwidth (rings) or splits its bytes by the share of peers
  on other nodes (all-to-all);
- TP/SP, CP, EP, ETP and PP transfers sit on the critical path (no overlap); FSDP/EDP
  gathers and reduce-scatters and HSDP all-reduces overlap with compute: charged is their
  excess over the step's compute, but at least one FSDP unit's share (nothing to overlap the
  first gather and the last reduce-scatter with);
- FSDP2 gathers every micro-batch without PP and once per step with PP (the written config
  sets fsdp_reshard_after_forward = "never" then; the stage stays unsharded anyway);
- step = (m + pp - 1) x (compute + exposed communication of one micro-batch on the busiest
  stage) + exposed FSDP; the pp - 1 extra slots are the 1F1B bubble (no virtual stages).
"""

import functools
import math
from dataclasses import asdict, dataclass, field, replace

import torch

from titan_fold.parallel.mesh import ATTENTION_DIMS, EXPERT_DIMS, Layout
from titan_fold.planning.sizes import ModelSizes

GIB = 1024**3
BF16, FP32 = 2, 4


# ---------------------------------------------------------------- inputs


@dataclass
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    intra_node_gbps: float = 450.0  # GB/s per GPU, one direction (NVLink 4 on H100)
    inter_node_gbps: float = 50.0  # GB/s per GPU (400 Gb/s InfiniBand per GPU)
    tflops: float = 989.0  # dense bf16 peak per GPU (H100 SXM)
    # achieved / peak: measured GEMM rates at these shapes are the record (bench/results/, tables in
    # docs/benchmarks.md); the rest of the step (norms, softmax, permutes) runs further below peak
    compute_efficiency: float = 0.6
    # GEMMs with few rows run below compute_efficiency: factor (t / (t + half)) / (1024 / (1024 + half)),
    # capped at 1, for t rows (tokens of a dense GEMM, routed rows of one expert); 1024 rows per
    # expert is the shape whose grouped-GEMM rate compute_efficiency stands for (bench/results/)
    gemm_half_rows: float = 128.0
    comm_efficiency: float = 0.7  # NCCL bus bandwidth / link bandwidth at tens of MiB
    reserve_gib: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    # the exact exchange reads its split sizes on the host before each expert all-to-all (two in
    # forward, two in backward per MoE layer with ep x etp > 1): the GPU idles that long each time.
    # 0 by default; bench/calibrate.py fits it on a measured run
    exchange_latency_s: float = 0.0


@dataclass
class Workload:
    seq_len: int
    global_batch: int  # sequences per optimizer step
    capacity_factor: float | None = None  # None: dropless
    # dropless: the busiest ep rank's routed rows over a balanced router's (1.0; planning/load.py)
    dropless_imbalance: float = 1.0
    compute_bytes: int = BF16  # activations, gathered parameters, communication (4: fp32 CPU runs)
    micro_batch: int = 1  # sequences per micro-batch (the planner searches 1 only)
    optimizer: str = "AdamW"  # "Muon": one momentum state and Newton-Schulz on owners (muon_* below)
    ns_steps: int = 5  # Muon's Newton-Schulz steps

    def microbatches(self, dp: int) -> int:
        return self.global_batch // (dp * self.micro_batch)


# ---------------------------------------------------------------- mappings


@dataclass(frozen=True)
class Mapping:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    etp: int
    edp: int
    recompute: str = "none"

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def folded(self) -> bool:
        """Not expressible in the legacy scheme (EP a subgroup of DP, expert TP == TP)."""
        return not (self.etp == self.tp and self.dp % self.ep == 0)

    def layout(self) -> Layout:
        return _GroupLayout(
            self.world,
            pp=self.pp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            cp=self.cp,
            tp=self.tp,
            ep=self.ep,
            etp=self.etp,
            edp=self.edp,
        )

    def short(self) -> str:
        att = f"pp{self.pp} dp{self.dp_replicate}x{self.dp_shard} cp{self.cp} tp{self.tp}"
        return f"{att} | ep{self.ep} etp{self.etp} edp{self.edp}"


class _GroupLayout(Layout):
    """The trainer's Layout, its group membership read without building a DeviceMesh.

    `Layout.groups` reads group membership off the root mesh tensors; init_device_mesh lays
    those out as arange(world).reshape(degrees), so here the same tensors are made directly:
    thousands of candidates cost milliseconds, not a mesh each (tests compare both on several
    layouts).
    """

    def root_ranks(self, mesh: str) -> tuple[torch.Tensor, tuple[str, ...]]:
        names = ATTENTION_DIMS if mesh == "attention" else EXPERT_DIMS
        return torch.arange(self.world_size).reshape(tuple(getattr(self, n) for n in names)), names


# ---------------------------------------------------------------- memory


@dataclass
class Memory:
    params: float  # bytes per GPU, busiest stage
    grads: float
    optimizer: float
    unsharded: float  # FSDP2's gathered bf16 parameters and unsharded gradients
    activations: float  # all micro-batches in flight
    backward: float  # gradients of one block's saved tensors while that block runs backward
    dispatcher: float  # one layer's send/receive buffers
    logits: float  # logits, fp32 log-softmax, fp32 logit gradients
    total: float
    total_worst_dropless: float  # every token of an EP group routed to this rank, in every layer

    def gib(self) -> dict:
        return {k: v / GIB for k, v in asdict(self).items()}


def _layers_per_stage(sizes: ModelSizes, pp: int) -> dict:
    return {"moe": math.ceil(sizes.n_moe_layers / pp), "dense": math.ceil((sizes.n_layers - sizes.n_moe_layers) / pp)}


def routed_rows(sizes: ModelSizes, m: Mapping, work: Workload, worst: bool = False) -> float:
    """Token copies one rank receives from the EP all-to-all, per MoE layer and micro-batch."""
    tokens = work.seq_len / (m.cp * m.tp)  # [tokens of this rank] after SP / CP
    if worst:  # every rank of the EP group sends all of its copies for our local experts
        return tokens * m.ep * min(sizes.top_k, sizes.num_experts // m.ep)
    factor = work.capacity_factor if work.capacity_factor is not None else work.dropless_imbalance
    return tokens * sizes.top_k * factor


def activation_bytes(
    sizes: ModelSizes, m: Mapping, work: Workload, kind: str = "moe", recompute: str = "none", worst: bool = False
) -> float:
    """Bytes one block keeps for backward, per rank and micro-batch (one sequence).

    The inventory of what autograd saves in the trainer's eager block (checked with
    saved_tensors_hooks on the debug model, docs/planning.md), per token:
      attention: each RMSNorm keeps its input, normalized input and output (3h) and 1/rms
      (fp32); q, k, v, the attention output and the flash log-sum-exp (fp32);
      MoE: the router input copy (h), logits (E, fp32), top-k indices (int64); per routed
      row: three int64 indices (the sort by expert, its inverse, the row's token; two more
      for the expert sort of received rows under ep or etp), its input (h), three ffn-wide
      tensors (w13's gate and up output, kept by the fused SwiGLU x probability, and w2's input)
      and the probability (the combine is a gather: w2's output is not kept);
      shared expert: input (h), three ffn-wide tensors, gate and output (h).
    T tokens per rank at the block boundary (sequence parallel: S / (cp tp)); Ta = S / cp
    tokens inside TP regions. 'full' keeps the block input only; 'selective' (torchtitan's op
    policy: matmul outputs saved, element-wise ops recomputed) keeps two ffn-wide tensors.
    """
    h, S, A = sizes.dim, work.seq_len, work.compute_bytes
    T, Ta = S / (m.cp * m.tp), S / m.cp
    if recompute == "full":
        return A * h * T
    qkv, out, kv_gathered, latent = _attention_widths(sizes)
    att = A * (6 * h * T + Ta * (qkv + out) / m.tp + Ta * latent)  # 2 norms x 3h, q k v, out, MLA latents
    att += FP32 * (Ta * sizes.n_heads / m.tp + 2 * T)  # log-sum-exp, 1/rms of both norms
    if m.cp > 1:  # K and V of the whole sequence, gathered over cp, saved for backward
        att += A * S * kv_gathered / m.tp
    selective = recompute == "selective"
    if kind == "dense":
        return att + A * Ta * (h + sizes.dense_ffn_dim / m.tp * (2 if selective else 3))
    rows = routed_rows(sizes, m, work, worst) * m.etp  # after the ETP all-gather
    moe = A * h * T + FP32 * T * sizes.num_experts + 8 * T * sizes.top_k  # router input, logits, top-k
    moe += 24 * rows / m.etp + (16 * rows if m.ep * m.etp > 1 else 0)  # int64 row indices
    moe += A * rows * (h + 1 + sizes.moe_ffn_dim / m.etp * (2 if selective else 3))
    if sizes.shared_ffn_dim:
        moe += A * Ta * (h + sizes.shared_ffn_dim / m.tp * (2 if selective else 3)) + A * T * (h + 1)
    return att + moe


def _attention_widths(sizes: ModelSizes) -> tuple[float, float, float, float]:
    """Per token: (q + k + v widths, attention output width, K + V width gathered under cp, all
    over every head; MLA's latents, replicated over tp: the q and kv latents with their norms'
    inputs and outputs and the rotary key)."""
    a = sizes.args
    if not hasattr(a, "kv_lora_rank"):
        kv = 2 * sizes.n_kv_heads * sizes.head_dim
        return sizes.n_heads * sizes.head_dim + kv, sizes.n_heads * sizes.head_dim, kv, 0.0
    qk, v = a.head_dim, a.v_head_dim  # q and k after the up-projections: nope + rope per head
    latent = 3 * (a.q_lora_rank or 0) + 3 * a.kv_lora_rank + a.qk_rope_head_dim
    return sizes.n_heads * (2 * qk + v), sizes.n_heads * v, sizes.n_heads * (qk + v), latent


def muon_local(sizes: ModelSizes, m: Mapping, work: Workload, first: bool = True, last: bool = True) -> float:
    """Elements of the parameters Muon orthogonalizes on one rank of the busiest stage (0 with AdamW)."""
    if work.optimizer != "Muon":
        return 0.0
    layers = _layers_per_stage(sizes, m.pp)
    dense = sum(layers[k] * sizes.muon_params_per_layer[k] for k in layers) / (m.tp * m.dp_shard * m.cp)
    return dense + layers["moe"] * sizes.expert_params_per_layer / (m.ep * m.etp * m.edp)


def optimizer_seconds(sizes: ModelSizes, m: Mapping, work: Workload, cluster: Cluster) -> float:
    """Muon's extra time per step on one rank: its share of the stage's Newton-Schulz FLOPs (owners
    balanced over the stage's ranks) at the GEMM rate, and each local element sent to its owner
    and back (two all-to-alls over the stage's ranks). 0 with AdamW, whose step is elementwise."""
    if work.optimizer != "Muon":
        return 0.0
    layers = _layers_per_stage(sizes, m.pp)
    flops = work.ns_steps * (
        sum(layers[k] * sizes.muon_flops_per_layer[k] for k in layers)
        + layers["moe"] * sizes.muon_expert_flops_per_layer
    )
    ranks = m.world // m.pp
    sent = 2 * muon_local(sizes, m, work) * work.compute_bytes * (ranks - 1) / ranks
    bandwidth = cluster.intra_node_gbps if ranks <= cluster.gpus_per_node else cluster.inter_node_gbps
    return flops / ranks / (cluster.tflops * 1e12 * cluster.compute_efficiency) + sent / (
        bandwidth * 1e9 * cluster.comm_efficiency
    )


def memory(sizes: ModelSizes, m: Mapping, work: Workload) -> Memory:
    """Peak bytes per GPU on the busiest pipeline stage (max of first and last)."""
    A = work.compute_bytes
    layers = _layers_per_stage(sizes, m.pp)
    fsdp, edp = m.dp_shard * m.cp, m.edp
    in_flight = min(m.pp, work.microbatches(m.dp))  # 1F1B: the first stage holds pp micro-batches

    def dense_local(first: bool, last: bool) -> float:  # this rank's TP shard of the stage's dense params
        n = sum(layers[k] * (sizes.tp_params_per_layer[k] / m.tp + sizes.rep_params_per_layer[k]) for k in layers)
        return n + (sizes.embedding_params / m.tp if first else 0) + (sizes.head_params / m.tp if last else 0)

    expert_local = layers["moe"] * sizes.expert_params_per_layer / (m.ep * m.etp)
    # with edp = 1 the routed experts are not FSDP units (parallelize.apply_fsdp)
    experts_fsdp = edp > 1
    # biggest FSDP unit gathered at once: one block, the embedding or the output head
    unit = max(
        sizes.tp_params_per_layer["moe"] / m.tp
        + (sizes.expert_params_per_layer / (m.ep * m.etp) if experts_fsdp else 0)
        if layers["moe"]
        else 0,
        sizes.tp_params_per_layer["dense"] / m.tp if layers["dense"] else 0,
        sizes.embedding_params / m.tp,
        sizes.head_params / m.tp,
    )

    # the same few (kind, recompute, worst) cases recur across the stages below
    known: dict[tuple, float] = {}

    def block_bytes(kind: str, rc: str, worst: bool) -> float:
        key = (kind, rc, worst)
        return known[key] if key in known else known.setdefault(key, activation_bytes(sizes, m, work, *key))

    stages = []
    for first, last in ((True, m.pp == 1), (False, True)) if m.pp > 1 else ((True, True),):
        dense = dense_local(first, last)
        sharded = dense / fsdp + expert_local / edp
        flight = in_flight if first else 1
        # two units of bf16 parameters (current + prefetched), one unit of bf16 + fp32 gradients
        unsharded = unit * (3 * A + FP32)
        if m.pp > 1:
            # torch.distributed.pipelining keeps FSDP2 modules unsharded after backward and defers
            # gradient sync to the last micro-batch: bf16 parameters and fp32 accumulated
            # gradients of the whole stage stay unsharded through the step
            unsharded += (dense + (expert_local if experts_fsdp else 0)) * (A + FP32)
        if not experts_fsdp and A < FP32:
            # experts outside FSDP cast their own weights; autograd keeps each forward's copy
            unsharded += expert_local * A * flight

        def acts(worst, rc=m.recompute, flight=flight):
            per_mb = sum(layers[k] * block_bytes(k, rc, worst) for k in layers)
            if rc == "full":  # one block is recomputed at a time and holds all its tensors
                per_mb += block_bytes("moe" if layers["moe"] else "dense", "none", worst)
            return per_mb * flight * work.micro_batch

        def grads_of_block(worst):
            return block_bytes("moe" if layers["moe"] else "dense", "none", worst) * work.micro_batch

        T = work.seq_len / (m.cp * m.tp)
        disp = (
            A * sizes.dim * (T * sizes.top_k + routed_rows(sizes, m, work)) * work.micro_batch if layers["moe"] else 0
        )
        disp_worst = (
            A * sizes.dim * (T * sizes.top_k + routed_rows(sizes, m, work, True)) * work.micro_batch
            if layers["moe"]
            else 0
        )
        logits = (A + 2 * FP32) * work.micro_batch * (work.seq_len / m.cp) * sizes.vocab / m.tp if last else 0
        muon = muon_local(sizes, m, work, first, last)
        # Muon: one fp32 momentum instead of two moments; an owner holds its units whole, gathered
        # and orthogonalized (balanced owners: about its own share), in the exchange's dtype
        optimizer = sharded * 2 * FP32 - muon * FP32
        unsharded += 2 * muon * A
        base = sharded * (FP32 + FP32) + optimizer + unsharded + logits
        activations, backward = acts(False), grads_of_block(False)
        stages.append(
            Memory(
                params=sharded * FP32,
                grads=sharded * FP32,
                optimizer=optimizer,
                unsharded=unsharded,
                activations=activations,
                backward=backward,
                dispatcher=disp,
                logits=logits,
                total=base + activations + backward + disp,
                total_worst_dropless=base + acts(True) + grads_of_block(True) + disp_worst,
            )
        )
    return max(stages, key=lambda s: s.total)


# ---------------------------------------------------------------- communication


@dataclass
class GroupComm:
    name: str
    bytes_per_step: float  # sent by one rank
    collective: str  # "ring" or "a2a" or "p2p"
    overlapped: bool
    size: int
    crossing: int = 0  # groups of this dim that span more than one node
    groups: int = 0
    inter_fraction: float = 0.0  # worst group: share of a rank's peers on other nodes
    seconds: float = 0.0
    units: int = 1  # FSDP units the volume is spread over: one unit's gather cannot overlap


def comm_volumes(sizes: ModelSizes, m: Mapping, work: Workload) -> dict[str, GroupComm]:
    """Bytes each rank sends per step, by group (only groups of size > 1)."""
    h, S, A = sizes.dim, work.seq_len, work.compute_bytes
    T, Ta = S / (m.cp * m.tp), S / m.cp
    layers = _layers_per_stage(sizes, m.pp)
    mb = work.global_batch // m.dp  # sequences per rank and step: activation traffic is per sequence
    fwd = 1.5 if m.recompute == "full" else 1.0  # full recompute repeats the forward collectives
    ring = lambda n: (n - 1) / n  # noqa: E731
    out = {}
    if m.tp > 1:
        # per block: AG before and RS after attention, the same around the shared expert / dense FFN
        per_layer = {k: 2 + (2 if (k == "dense" or sizes.shared_ffn_dim) else 0) for k in layers}
        n = sum(layers[k] * per_layer[k] for k in layers)
        out["tp"] = GroupComm("tp", mb * n * 2 * fwd * A * h * Ta * ring(m.tp), "ring", False, m.tp)
    n_layers = layers["moe"] + layers["dense"]
    if m.cp > 1:  # K, V all-gather forward, reduce-scatter of their grads backward
        kv = A * S * _attention_widths(sizes)[2] / m.tp * ring(m.cp)
        out["cp"] = GroupComm("cp", mb * n_layers * 2 * fwd * kv, "ring", False, m.cp)
    rows = routed_rows(sizes, m, work)  # what this rank sends equals what it receives, on average
    if m.ep > 1:  # dispatch + combine, forward and backward
        # each of a token's top_k copies travels on its own; group- or node-limited routing
        # (moe.num_groups, moe.group_topk) bounds the nodes a token reaches, not the share of
        # copies that leave the node, which stays 1 - 1/nodes under uniform load (docs/moe.md)
        out["ep"] = GroupComm("ep", mb * layers["moe"] * 4 * fwd * A * h * rows * ring(m.ep), "a2a", False, m.ep)
    if m.etp > 1:  # AG-v of the received tokens + RS-v of the partial outputs, forward and backward
        out["etp"] = GroupComm("etp", mb * layers["moe"] * 4 * fwd * A * h * rows * (m.etp - 1), "ring", False, m.etp)
    if m.pp > 1:  # activations forward, their gradients backward, at one stage boundary
        out["pp"] = GroupComm("pp", mb * 2 * A * h * T, "p2p", False, m.pp)
    # FSDP2 without PP: AG forward and backward, gradient RS, every micro-batch (reshard after
    # forward). With PP the pipeline keeps the stage unsharded after backward and defers gradient
    # sync to the last micro-batch; with fsdp_reshard_after_forward = "never" (job_toml writes it)
    # the stage is gathered once per step
    gathers = 1 if m.pp > 1 else 2 * work.microbatches(m.dp)
    syncs = 1 if m.pp > 1 else work.microbatches(m.dp)
    dense = sum(layers[k] * sizes.tp_params_per_layer[k] / m.tp for k in layers) + (
        (sizes.embedding_params + sizes.head_params) / m.tp
        if m.pp == 1
        else max(sizes.embedding_params, sizes.head_params) / m.tp
    )
    experts = layers["moe"] * sizes.expert_params_per_layer / (m.ep * m.etp)
    fsdp = m.dp_shard * m.cp
    dense_units = n_layers + (2 if m.pp == 1 else 1)  # blocks, embedding and/or head
    if fsdp > 1:
        out["dp_shard_cp"] = GroupComm(
            "dp_shard_cp", dense * ring(fsdp) * (gathers * A + syncs * FP32), "ring", True, fsdp, units=dense_units
        )
    if m.edp > 1:
        out["edp"] = GroupComm(
            "edp",
            experts * ring(m.edp) * (gathers * A + syncs * FP32),
            "ring",
            True,
            m.edp,
            units=max(layers["moe"], 1),
        )
    if m.dp_replicate > 1:  # HSDP: all-reduce of the sharded dense gradients
        out["dp_replicate"] = GroupComm(
            "dp_replicate",
            syncs * dense / fsdp * FP32 * 2 * ring(m.dp_replicate),
            "ring",
            True,
            m.dp_replicate,
            units=dense_units,
        )
    return out


def _node_stats(groups: torch.Tensor, gpus_per_node: int) -> tuple[int, float]:
    """groups [groups, size] -> (groups spanning more than one node, largest share of a group's pairs off-node)."""
    nodes, size = groups // gpus_per_node, groups.shape[1]
    crossing = int((nodes.amin(1) != nodes.amax(1)).sum())
    if not crossing:
        return 0, 0.0
    # [groups, nodes] members per node, not member pairs: a group's size is up to the world's
    per_node = nodes.new_zeros(len(nodes), int(nodes.max()) + 1).scatter_add_(1, nodes, torch.ones_like(nodes))
    same = (per_node * per_node).sum(1)  # [groups] ordered pairs on one node, each member with itself too
    return crossing, float(((size * size - same) / (size * (size - 1))).max())


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Groups spanning two dims of one row-major mesh, from each dim's groups [groups, size]: a
    rank's group is every sum of a member of its a-group and a member of its b-group, less itself,
    so its smallest member is the smallest of its a-group's b-groups' smallest members. -> The
    groups in the order of their smallest ranks, each one's members in order."""
    rank, lowest_b, group = torch.arange(a.numel()), torch.empty_like(b.flatten()), torch.empty_like(a.flatten())
    lowest_b[b] = b.amin(1, keepdim=True).expand_as(b)  # [rank] smallest member of its b-group
    group[a] = lowest_b[a].amin(1, keepdim=True).expand_as(a)  # [rank] smallest member of its group
    return rank[torch.argsort(group * a.numel() + rank)].view(-1, a.shape[1] * b.shape[1])


def group_rows(m: Mapping, legacy: bool = False) -> dict[str, torch.Tensor]:
    """Every group of each communicating dim, from the trainer's Layout: {dim: [groups, size]}.

    legacy=True: Megatron-Core's order without folding (tp-cp-ep-dp-pp, EP inside DP, expert
    TP = TP). Its expert groups are the attention mesh's groups of a Layout whose dp is split
    as dp_replicate = dp / ep (slow) x dp_shard = ep (fast): ep = that layout's dp_shard groups,
    edp = its dp_replicate x cp groups.
    """
    lay = m.layout()
    names = ("tp", "cp", "dp_shard_cp", "dp_replicate", "ep", "etp", "edp")
    out = {k: lay.group_rows(k, "expert" if k in ("ep", "etp", "edp") else "attention") for k in names}
    out["pp"] = lay.group_rows("pp")
    if legacy:
        old = Mapping(m.pp, m.dp // m.ep, m.ep, m.cp, m.tp, 1, 1, m.world // m.pp).layout()
        out["ep"] = old.group_rows("dp_shard")
        out["etp"] = old.group_rows("tp")
        out["edp"] = _product(old.group_rows("dp_replicate"), old.group_rows("cp"))
    return out


def group_membership(m: Mapping, legacy: bool = False) -> dict[str, list[list[int]]]:
    """group_rows as lists of global ranks."""
    return {k: v.tolist() for k, v in group_rows(m, legacy).items()}


@functools.lru_cache(maxsize=4096)
def node_stats(m: Mapping, gpus_per_node: int, legacy: bool = False) -> dict[str, tuple[int, float, int]]:
    """{dim: (groups crossing a node boundary, worst share of peers off-node, groups)}; m.recompute ignored."""
    return {name: (*_node_stats(gs, gpus_per_node), len(gs)) for name, gs in group_rows(m, legacy).items()}


# ---------------------------------------------------------------- step time


@dataclass
class Estimate:
    mapping: Mapping
    memory: Memory
    comm: dict
    compute_s: float  # per micro-batch, busiest stage
    exposed_comm_s: float  # per micro-batch: TP, CP, EP, ETP, PP
    exposed_fsdp_s: float  # per step
    bubble_s: float
    step_s: float
    mfu: float
    fits: bool
    headroom_gib: float
    tokens_per_step: int
    legacy_groups: bool = False
    dominant: str = ""
    reasons: list = field(default_factory=list)
    optimizer_s: float = 0.0  # per step: Muon's Newton-Schulz and exchanges (0 with AdamW)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.mapping.world


def _seconds(c: GroupComm, cluster: Cluster) -> float:
    intra = cluster.intra_node_gbps * 1e9 * cluster.comm_efficiency
    inter = cluster.inter_node_gbps * 1e9 * cluster.comm_efficiency
    if not c.crossing:
        return c.bytes_per_step / intra
    if c.collective == "a2a":  # bytes to peers on this node and on others go in parallel
        return max(c.bytes_per_step * (1 - c.inter_fraction) / intra, c.bytes_per_step * c.inter_fraction / inter)
    return c.bytes_per_step / inter


def estimate(
    sizes: ModelSizes,
    m: Mapping,
    work: Workload,
    cluster: Cluster,
    groups: bool = True,
    legacy: bool = False,
    mem: Memory | None = None,
) -> Estimate:
    """Step time and memory of one mapping; groups=False: every group inside a node (a lower bound);
    legacy: the legacy (unfolded) scheme's expert groups; mem: `memory(sizes, m, work)` if known."""
    mem = mem or memory(sizes, m, work)
    comm = comm_volumes(sizes, m, work)
    stats = node_stats(replace(m, recompute="none"), cluster.gpus_per_node, legacy) if groups else {}
    for name, c in comm.items():
        if groups:
            c.crossing, c.inter_fraction, c.groups = stats[name]
        c.seconds = _seconds(c, cluster)
    layers = _layers_per_stage(sizes, m.pp)
    routed = 6 * sizes.expert_params_per_layer * sizes.top_k / sizes.num_experts * layers["moe"]
    dense = sum(layers[k] * sizes.flops_per_token_layer[k] for k in layers) - routed
    if m.recompute == "full":  # one more forward
        dense, routed = dense * 8 / 6, routed * 8 / 6
    dense += sizes.flops_per_token_head  # bound: the busiest stage also holds the head

    def gemm(rows: float) -> float:
        half = cluster.gemm_half_rows
        return min(1.0, rows / (rows + half) * (1024 + half) / 1024)

    expert_rows = routed_rows(sizes, m, work) * m.etp * work.micro_batch / (sizes.num_experts / m.ep)
    dense_rows = work.seq_len * work.micro_batch / m.cp
    flops_rate = cluster.tflops * 1e12 * cluster.compute_efficiency
    mb = work.microbatches(m.dp)
    rank_tokens = work.micro_batch * work.seq_len / (m.cp * m.tp)  # per rank and micro-batch
    busiest = work.dropless_imbalance if work.capacity_factor is None else 1.0  # the slowest ep rank's share
    compute = rank_tokens * (dense / gemm(dense_rows) + routed * busiest / gemm(expert_rows)) / flops_rate
    exposed = sum(c.seconds for c in comm.values() if not c.overlapped) / mb
    waits = 4 * layers["moe"] * cluster.exchange_latency_s if m.ep * m.etp > 1 else 0.0
    exposed += waits
    # FSDP traffic hides behind compute, except one unit's share: the first gather of a pass
    # and the last reduce-scatter have nothing to overlap with
    overlapped = [c for c in comm.values() if c.overlapped]
    fsdp = max(sum(c.seconds / c.units for c in overlapped), sum(c.seconds for c in overlapped) - mb * compute)
    slot = compute + exposed
    bubble = (m.pp - 1) * slot
    optimizer = optimizer_seconds(sizes, m, work, cluster)
    step = mb * slot + bubble + fsdp + optimizer
    tokens = work.global_batch * work.seq_len
    mfu = sizes.flops_per_token * tokens / (m.world * cluster.tflops * 1e12 * step)
    capacity = (cluster.gpu_memory_gib - cluster.reserve_gib) * GIB
    est = Estimate(
        m,
        mem,
        comm,
        compute,
        exposed,
        fsdp,
        bubble,
        step,
        mfu,
        mem.total <= capacity,
        (capacity - mem.total) / GIB,
        tokens,
        legacy_groups=legacy,
        optimizer_s=optimizer,
    )
    costs = {"compute": mb * compute, "pp bubble": bubble, "fsdp/edp (exposed)": fsdp, "optimizer": optimizer}
    costs.update({f"{n} comm": c.seconds for n, c in comm.items() if not c.overlapped})
    if waits:
        costs["exchange host waits"] = mb * waits
    est.dominant = max(costs, key=costs.__getitem__)
    cross = [f"{n}({c.crossing}/{c.groups})" for n, c in comm.items() if c.crossing]
    est.reasons = [
        f"dominant: {est.dominant} {costs[est.dominant]:.2f}s of {step:.2f}s",
        f"headroom {est.headroom_gib:.1f} GiB" + ("" if est.fits else " (OOM)"),
        "crossing nodes: " + (", ".join(cross) if cross else "none"),
    ]
    return est
