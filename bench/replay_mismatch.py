"""Routing replay against a real train/inference mismatch, one GPU (docs/rl.md, "Measured").

    python bench/replay_mismatch.py                      # Qwen3-MoE proxy, 64 rollouts of 64 + 192 tokens
    python bench/replay_mismatch.py --smoke              # CPU, the debug model (tests)

1. titan_fold's Trainer (titan_fold/api.py) builds the proxy (qwen3_moe at Qwen3-30B-A3B widths, 4
   layers, 32K vocabulary; bench/train_step.py's register_proxy) from debug.seed and writes its
   weights as a Hub folder (save_hub).
2. The inference engine: transformers' Qwen3-MoE in bf16 on that folder samples the rollouts
   (random prompts, temperature 1), then one forward over each whole sequence gives the behaviour
   log-probs and, from its router logits, the top-k experts of every (token, MoE layer).
3. From the same seed (the same weights, checked), two trainers, compiled with bf16 weights and
   training.objective = "policy", take the rollouts: moe.routing_replay = "off", then "rollout".
   Each computes the log-probs (logprobs()) and trains steps on the rollouts (train_step()).

Figures: the share of (token, layer) routings where titan_fold's router picks another top-k set
than the engine (the rollout trainer's first step, `routing_replay_changed`); over the response
tokens, the mean absolute log-prob gap and the k3 estimate of KL(engine, trainer) off and with
replay; the median step time of each (after --warmup steps) and their ratio.
"""

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import script_parser, write_result  # noqa: E402
from bench.train_step import register_proxy  # noqa: E402


def trainer_args(a, dump: str, mode: str | None, rollouts: str | None) -> list[str]:
    """The job config of one trainer: the proxy, bf16 weights, compiled on a GPU; with rollouts, the
    policy objective on them and moe.routing_replay = mode."""
    args = ["--job.dump_folder", dump, "--model.name", a.family, "--model.flavor", a.proxy]
    args += ["--debug.seed", "0", "--training.seq_len", str(a.seq_len), "--model.max_seq_len", str(a.seq_len)]
    args += ["--training.local_batch_size", str(a.batch), "--training.global_batch_size", str(a.batch)]
    args += ["--training.steps", "1000", "--lr_scheduler.warmup_steps", "0", "--optimizer.lr", "1e-6"]
    args += ["--activation_checkpoint.mode", "none", "--metrics.log_freq", "1"]
    if not a.smoke:
        args += ["--training.dtype", "bfloat16", "--compile.enable"]
    if rollouts is not None:
        args += ["--training.dataset", "hf", "--training.dataset_path", rollouts]
        args += ["--training.dataset_format", "rollouts", "--training.objective", "policy"]
        args += ["--moe.routing_replay", mode or "off"]
    return args


def checksum(trainer) -> float:
    """A sum over every streamed weight: equal seeds give equal weights."""
    return sum(float(t.double().sum()) for _, t in trainer.weights())


def sample(a, hf_folder: str, device: torch.device) -> list[dict]:
    """The engine's rollouts: tokens, the response's loss_mask, its log-probs and routed experts."""
    import transformers

    dtype = torch.float32 if a.smoke else torch.bfloat16
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=dtype).to(device).eval()
    gen = torch.Generator(device="cpu").manual_seed(1)
    prompts = torch.randint(1, hf.config.vocab_size, (a.rollouts, a.prompt), generator=gen).to(device)
    torch.manual_seed(2)
    with torch.no_grad():
        tokens = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=a.response,
            min_new_tokens=a.response,
            pad_token_id=0,
            eos_token_id=None,
        )  # [n, prompt + response]
        out = hf(tokens, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    n, s = tokens.shape
    routed = torch.stack([logits.view(n, s, -1).topk(k, dim=-1).indices for logits in out.router_logits], dim=2)
    logprobs = torch.log_softmax(out.logits.float(), dim=-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    logprobs = torch.cat([torch.zeros(n, 1, device=device), logprobs], dim=1).clamp(max=0.0)
    advantages = torch.randn(n, generator=torch.Generator().manual_seed(3))
    del hf, out
    return [
        {
            "tokens": tokens[i].tolist(),
            "loss_mask": [0] * a.prompt + [1] * a.response,
            "advantages": float(advantages[i]),
            "logprobs": logprobs[i].tolist(),
            "routed_experts": routed[i].tolist(),
        }
        for i in range(n)
    ]


def gaps(records: list[dict], ours: list[torch.Tensor]) -> dict:
    """Over the response tokens: mean |logp - b| and mean k3 = exp(d) - d - 1, d = b - logp."""
    d = torch.cat(
        [
            (torch.tensor(r["logprobs"], dtype=torch.float64) - lp.double())[torch.tensor(r["loss_mask"]) == 1]
            for r, lp in zip(records, ours, strict=True)
        ]
    )
    return {"logprob_gap": float(d.abs().mean()), "kl_k3": float((d.exp() - d - 1).mean())}


def timed_steps(trainer, records: list[dict], warmup: int, iters: int, device: torch.device) -> tuple[list, dict]:
    """Step times in ms (after warmup) and the first step's metrics."""
    times, first = [], None
    for i in range(warmup + iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.train_step(records)
        if device.type == "cuda":
            torch.cuda.synchronize()
        first = first or metrics
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times, first


def main() -> None:
    p = script_parser(__doc__, "replay_mismatch", warmup=3, iters=10, smoke="the qwen3_moe debug model on the CPU")
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--proxy", default="30B-A3B-L4")
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=192)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="rows of seq-len tokens a step holds")
    a = p.parse_args()
    if a.smoke:
        a.proxy, a.rollouts, a.prompt, a.response, a.seq_len, a.batch = "debug", 4, 8, 24, 64, 2
        a.warmup, a.iters = 1, 2
    register_proxy(a.family, a.proxy)
    from titan_fold.api import Trainer

    device = torch.device(a.device)
    figures: dict = {"family": a.family, "proxy": a.proxy, "rollouts": a.rollouts, "prompt": a.prompt}
    figures["response"] = a.response
    with tempfile.TemporaryDirectory() as tmp:
        built = Trainer.from_config("debug_moe.toml", trainer_args(a, os.path.join(tmp, "seed"), None, None))
        seed_sum = checksum(built)
        built.save_hub(os.path.join(tmp, "hf"))
        built.close()
        records = sample(a, os.path.join(tmp, "hf"), device)
        path = os.path.join(tmp, "rollouts.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        for mode in ("off", "rollout"):
            trainer = Trainer.from_config("debug_moe.toml", trainer_args(a, os.path.join(tmp, mode), mode, path))
            with contextlib.ExitStack() as stack:
                stack.callback(trainer.close)
                figures[f"{mode}_same_weights"] = checksum(trainer) == seed_sum
                figures[mode] = gaps(records, trainer.logprobs(records))
                times, first = timed_steps(trainer, records, a.warmup, a.iters, device)
                figures[mode].update(step_ms=statistics.median(times), step_ms_all=times)
                figures[mode]["routing_replay_changed"] = first.get("routing_replay_changed")
    figures["routings_differing"] = figures["rollout"]["routing_replay_changed"]
    figures["replay_over_off_step_ms"] = figures["rollout"]["step_ms"] / figures["off"]["step_ms"]
    print(json.dumps(figures, indent=1))
    write_result(a.name, figures, a.out_dir)


if __name__ == "__main__":
    main()
