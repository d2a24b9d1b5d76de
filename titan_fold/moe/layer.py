"""The MoE layer: router -> dispatcher (routed experts) + shared expert; the SwiGLU FFN."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan_fold.common.moe_config import split_wgrad
from titan_fold.moe.args import MoEArgs
from titan_fold.moe.dispatcher import TokenDispatcher
from titan_fold.moe.experts import GroupedExperts
from titan_fold.moe.router import AddAuxLoss, Router
from titan_fold.moe.swiglu import swiglu
from titan_fold.moe.wgrad import WgradQueue


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). A dense layer's FFN, and the MoE's shared expert,
    which every token goes through (Qwen2-MoE). The SwiGLU itself is the routed experts'
    fused one (moe/experts.py)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))

    def init_weights(self, init_std: float, out_std: float):
        # truncated at 3 standard deviations: no rare huge weights at start
        for w, std in ((self.w1.weight, init_std), (self.w3.weight, init_std), (self.w2.weight, out_std)):
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)


class MoE(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(
            dim,
            args.moe_ffn_dim,
            args.num_experts,
            args.expert_kernels,
            args.activation,
            args.expert_biases,
        )
        if split_wgrad(args.ep_overlap):
            self.experts.wgrad = WgradQueue()
        self.shared_expert = FeedForward(dim, args.shared_ffn_dim) if args.shared_ffn_dim > 0 else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if args.shared_expert_gate else None
        # one rank holding every expert and whole sequences; the parallelize step replaces it
        # by one built for the layout (parallel/experts.py)
        self.dispatcher = TokenDispatcher(args)
        # the ranks holding the other parts of this rank's sequences (attention cp x tp), over
        # which the router's aux-loss statistics are summed; set with the dispatcher
        self.seq_mesh: DeviceMesh | None = None
        # local_tokens / global_tokens of the micro-batch, set by the trainer, so the aux
        # losses' gradients are normalized like the LM loss
        self.register_buffer("aux_loss_scale", torch.ones(()), persistent=False)
        # metrics since the last moe_stats(): sums of (balance loss, dropped frac, imbalance), calls
        self.register_buffer("stats", torch.zeros(4), persistent=False)
        # aux_free: routed assignments per expert since the last update_expert_bias()
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        # routed assignments per expert since the trainer last read them (metrics.expert_load)
        self.register_buffer("load", torch.zeros(args.num_experts), persistent=False)
        # routing replay: (routings whose replayed experts differ from the router's own choice,
        # routings) since the last moe_stats()
        self.register_buffer("replay_changed", torch.zeros(2), persistent=False)
        # routing replay's record pass (moe/replay.py: record_routing): the chosen experts of each
        # call [T, k] are appended here; None = not recording
        self.recorded: list[torch.Tensor] | None = None
        # the layer's place among its model's MoE layers, and their number (routed_experts' layer
        # dim); set by the model's block. None: routing replay does not cover the layer (an MTP
        # layer's), its router always chooses
        self.moe_index: int | None = 0
        self.n_moe_layers = 1

    def forward(self, x: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, dim] this rank's tokens; routed_experts [b, s, k] int64: the experts to replay
        for them (moe.routing_replay), None = the router's choice."""
        b, s, dim = x.shape
        tokens = x.reshape(b * s, dim)  # [T, dim]
        replayed = None if routed_experts is None else routed_experts.reshape(b * s, -1).contiguous()  # [T, k]
        routing = self.router(tokens, s, self.aux_loss_scale, self.seq_mesh, replayed)
        if self.recorded is not None:
            self.recorded.append(routing.experts.detach().view(b, s, -1))
        shared_y = overlap = None
        if self.shared_expert is not None and self.args.shared_expert_overlap:
            # run while the routed tokens are exchanged (Megatron-Core's shared-expert overlap)
            overlap = lambda: self._shared(tokens)  # noqa: E731
        elif self.shared_expert is not None:
            shared_y = self._shared(tokens)
        y, keep, overlapped = self.dispatcher(
            tokens, routing.probs, routing.experts, self.experts, self.args, b, overlap=overlap
        )  # [T, dim]
        if overlapped is not None:
            shared_y = overlapped
        if shared_y is not None:
            y = y + shared_y
        if self.args.load_balance in ("aux_loss", "seq_aux_loss") or self.args.z_loss_coeff > 0:
            y = AddAuxLoss.apply(y, routing.loss)
        self._record(routing, keep)
        return y.view(b, s, dim)

    def _shared(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.shared_expert is not None  # called only with a shared expert
        shared = self.shared_expert(tokens)  # [T, dim]
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
        return shared

    @torch.no_grad()
    def _record(self, routing, keep):
        if self.recorded is not None:
            return  # routing replay's record pass: not a training forward, counted nowhere
        # device-side accumulation: no host sync inside forward
        if routing.changed is not None:
            self.replay_changed.add_(routing.changed)
        self.stats.add_(routing.record)
        self.load.add_(routing.tokens_per_expert)
        if keep is not None:
            self.stats[1].add_(1.0 - keep.float().mean())
        if self.args.load_balance == "aux_free":
            self.tokens_per_expert.add_(routing.tokens_per_expert)

    def init_weights(self, init_std: float):
        self.router.init_weights(0.02)
        self.experts.init_weights(init_std)
        if self.shared_expert is not None:
            for lin in (self.shared_expert.w1, self.shared_expert.w2, self.shared_expert.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std)
        if self.shared_expert_gate is not None:
            nn.init.trunc_normal_(self.shared_expert_gate.weight, mean=0.0, std=init_std)
        # buffers made on the meta device hold garbage after to_empty()
        self.aux_loss_scale.fill_(1.0)
        self.stats.zero_()
        self.tokens_per_expert.zero_()
        self.load.zero_()
        self.replay_changed.zero_()


def moe_layers(model_parts) -> list[MoE]:
    """Every MoE layer of a module or a list of them (a pipeline rank's model parts)."""
    parts = model_parts if isinstance(model_parts, (list, tuple)) else [model_parts]
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


def moe_stashes(model_parts) -> list:
    """The distinct stashes (moe.stash_rows, moe/stash.py) of the MoE layers of a module or a list of them."""
    found = {
        id(m.dispatcher.stash): m.dispatcher.stash for m in moe_layers(model_parts) if m.dispatcher.stash is not None
    }
    return list(found.values())


@torch.no_grad()
def moe_stats_values(model_parts) -> torch.Tensor | None:
    """The MoE layers' statistics since the last call, then reset, as one tensor on their device
    (no host sync): [6] = the means of (aux loss, dropped share, load imbalance) over the layers
    that ran, each layer's over its calls, the number of layers that ran, and the (token, layer)
    routings routing replay changed and replayed. None without MoE layers."""
    layers = moe_layers(model_parts)
    if not layers:
        return None
    stats = torch.stack([module.stats for module in layers])  # [layers, 4]: three sums and the calls
    replay = torch.stack([module.replay_changed for module in layers]).sum(0)  # [2]
    for module in layers:
        module.stats.zero_()
        module.replay_changed.zero_()
    calls = stats[:, 3]
    ran = (calls > 0).to(stats.dtype)
    per_layer = stats[:, :3] / calls.clamp(min=1)[:, None]
    return torch.cat([(per_layer * ran[:, None]).sum(0) / ran.sum().clamp(min=1), ran.sum()[None], replay])


def moe_stats_from(values: torch.Tensor | None) -> dict:
    """moe_stats_values' tensor read on the host: {} where no layer ran."""
    if values is None:
        return {}
    aux, dropped, imbalance, layers_ran, changed, replayed = values.tolist()
    if not layers_ran:
        return {}
    replay = {"routing_replay_changed": changed / replayed} if replayed else {}
    return {"moe_aux_loss": aux, "dropped_token_frac": dropped, "expert_load_imbalance": imbalance, **replay}


def moe_stats(model_parts) -> dict:
    """Averages over MoE layers (each over its calls since the last moe_stats), then reset.

    One host sync, here, outside forward. Returns {} when no layer ran.
    """
    return moe_stats_from(moe_stats_values(model_parts))


@torch.no_grad()
def update_expert_bias(model_parts, all_reduce=None) -> None:
    """aux_free load balancing, called after optimizer.step().

    bias_e += rate * sign(mean_load - load_e): overloaded experts become less attractive.
    `all_reduce(t) -> t` sums the load over the ranks whose tokens share a router (it may
    work in place and return None); without it each rank uses its own load.
    """
    for module in moe_layers(model_parts):
        if module.args.load_balance != "aux_free":
            continue
        load = module.tokens_per_expert.clone()
        if all_reduce is not None:
            reduced = all_reduce(load)
            load = load if reduced is None else reduced
        delta = module.args.aux_free_bias_update_rate * torch.sign(load.mean() - load)
        module.router.expert_bias.add_(delta.to(module.router.expert_bias.dtype))
        module.tokens_per_expert.zero_()
