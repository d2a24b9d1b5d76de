"""Benchmark-only routing with a load chosen in advance (train_step.py's `skew` and `uniform`
modifiers): the router runs as always (its gate, losses and their gradients), then each token's
k experts are drawn again, distinct, from a fixed distribution over the experts:

- skew: the first quarter of the expert ids (at ep 2 all on ep rank 0) weighs three times the
  rest, so that they take about half the picks: the skewed step that copies of hot experts
  (moe.hot_expert_replicas) exist for;
- uniform: every expert alike, the balanced ideal the copies are measured against.

The combine weights stay the router's top-k probabilities, given to the drawn experts: the
speed of a step depends on where rows go, not on these values. The load the step then logs
(expert_load_imbalance, the tokens per expert of aux-free balancing) counts the drawn experts.
"""

import contextlib

import torch

SKEW_WEIGHT = 3.0  # a quarter of the experts at 3x the weight of the others: half the picks


def weights(kind: str, num_experts: int) -> torch.Tensor:
    """[E] the draw's weight of each expert."""
    w = torch.ones(num_experts)
    if kind == "skew":
        w[: num_experts // 4] = SKEW_WEIGHT
    return w


@contextlib.contextmanager
def forced_routing(kind: str | None):
    """While inside, every Router's picks are drawn from `weights(kind)`; None: unchanged."""
    if kind is None:
        yield
        return
    from titan_fold.moe.router import Router

    original = Router.forward

    def forward(self, x, seq_len, *args, **kwargs):
        routing = original(self, x, seq_len, *args, **kwargs)
        E, (T, k) = self.args.num_experts, routing.experts.shape
        w = weights(kind, E).to(x.device)
        picks = torch.multinomial(w.expand(T, E), k, replacement=False)  # [T, k] distinct
        load = torch.zeros(E, device=x.device).scatter_add_(0, picks.flatten(), torch.ones(T * k, device=x.device))
        record = routing.record.clone()
        record[2] = load.max() / load.mean()
        routing.experts, routing.tokens_per_expert, routing.record = picks, load, record
        return routing

    Router.forward = forward
    try:
        yield
    finally:
        Router.forward = original
