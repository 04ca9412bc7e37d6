"""TRL's GRPO quickstart (the GRPOTrainer example of TRL 1.16's README) on periodic_async: the
import line is the one change to TRL's code.

    python -m periodic_async prepare-model smollm2-135m     # artifacts/smollm2-135m-instruct (once)
    python examples/trl_quickstart.py                        # 10 optimizer steps on it

What differs from TRL's copy besides the import, so that it runs offline and overlaps:
- the model is the prepared SmolLM2-135M-Instruct directory, not a hub id (`--model`: any model
  directory, hub id in the local cache, or preset name);
- the dataset has TRL's DeepMath-103K columns, `prompt` (chat messages) and `solution`, made here
  from arithmetic problems (`--dataset trl-lib/DeepMath-103K` loads TRL's own where the hub is
  reachable: HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0);
- a GRPOConfig asks for 8 prompts x 4 completions a step: TRL's default, 1 prompt x 8, leaves the
  trainer nothing to overlap with generation (docs/trl.md, "The batch overlap needs").
"""

import argparse
import random

from datasets import Dataset, load_dataset
from trl.rewards import accuracy_reward

from periodic_async import GRPOConfig, GRPOTrainer  # TRL's quickstart: from trl import GRPOTrainer


def arithmetic(n: int, seed: int = 0) -> Dataset:
    """n sums in DeepMath-103K's columns: `prompt` (one user message) and `solution` (the answer)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Put the answer in \\boxed{{}}."}],
                     "solution": str(a + b)})
    return Dataset.from_list(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artifacts/smollm2-135m-instruct",
                   help="made by `python -m periodic_async prepare-model smollm2-135m`")
    p.add_argument("--dataset", default=None, help="a hub dataset with prompt and solution columns")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--output-dir", default="runs/trl_quickstart")
    args = p.parse_args(argv)

    dataset = load_dataset(args.dataset, split="train") if args.dataset else arithmetic(256)
    training_args = GRPOConfig(output_dir=args.output_dir, per_device_train_batch_size=8 * 4, num_generations=4,
                               max_steps=args.max_steps, max_completion_length=args.max_completion_length)

    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=accuracy_reward,
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()


if __name__ == "__main__":
    main()
