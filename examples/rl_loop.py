"""An RL loop's trainer side on the Python API (docs/rl.md, "Python API"), on the CPU.

    python examples/rl_loop.py --steps 3

The debug Qwen3-MoE model trains on the embedded rollouts (titan_fold/data/rollouts_example.jsonl:
tokens, loss_mask, advantages, the engine's log-probs and routed experts), as an RL loop would on
each new batch from its inference engine: the log-probs of the current weights, one policy step
with the engine's routing replayed (moe.routing_replay = "rollout", R3), and the weights streamed
out under their Hugging Face names, as to an engine's load_weights. Then a checkpoint, and a new
trainer resumes it.
"""

import argparse
import json
import os
import tempfile

from titan_fold.api import Trainer
from titan_fold.data.dataloader import ROLLOUTS_EXAMPLE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--replay", default="rollout", choices=["off", "rollout", "recorded"])
    a = p.parse_args()
    with open(ROLLOUTS_EXAMPLE) as f:
        records = [json.loads(line) for line in f]
    with tempfile.TemporaryDirectory() as dump:
        config = [
            *("--job.dump_folder", dump, "--checkpoint.enable"),
            # the job config's data: the embedded rollouts (the batches below come from the loop)
            *("--training.dataset", "rollouts_example", "--training.dataset_format", "rollouts"),
            *("--training.objective", "policy", "--moe.routing_replay", a.replay),
            *("--training.seq_len", "256", "--training.local_batch_size", "4"),
            *("--training.global_batch_size", "4", "--training.steps", str(a.steps)),
        ]
        trainer = Trainer.from_config("debug_moe.toml", config)
        for step in range(a.steps):
            batch = records[4 * (step % 4) : 4 * (step % 4) + 4]  # the engine's next rollouts
            old = trainer.logprobs(batch)  # the current weights' log-probs (R2 records here)
            metrics = trainer.train_step(batch)
            streamed = sum(t.numel() for _, t in trainer.weights())  # an engine's load_weights takes these
            gap = sum(
                abs(float(lp[i]) - r["logprobs"][i])
                for r, lp in zip(batch, old, strict=True)
                for i in range(1, len(lp))
            )
            print(
                f"step {metrics['step']}: loss {metrics['loss']:+.4f}  ratio {metrics['policy_ratio_mean']:.3f}  "
                f"clip {metrics['policy_clip_frac']:.3f}  replay changed {metrics['routing_replay_changed'] or 0:.3f}  "
                f"summed gap to the engine {gap:.1f}  streamed {streamed:,} weights"
            )
        print(f"saved {os.path.relpath(trainer.save(), dump)}")
        trainer.close()
        resumed = Trainer.from_config("debug_moe.toml", config)
        print(f"resumed at step {resumed.step}")
        resumed.close()


if __name__ == "__main__":
    main()
