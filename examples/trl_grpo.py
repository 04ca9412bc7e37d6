"""One GRPO script in TRL's shape, timed on both libraries by experiments/trl_dropin.py.

A dataset with a `prompt` column, reward functions, GRPOConfig, GRPOTrainer: it runs on
periodic_async's pipeline as written and, with the import line below switched to
`from trl import GRPOConfig, GRPOTrainer`, on TRL, unchanged otherwise. (TRL's own quickstart on
us: examples/trl_quickstart.py.)

    python -m periodic_async prepare-model smollm2-135m          # artifacts/smollm2-135m-instruct (once)
    python examples/trl_grpo.py --max-steps 10
    python examples/trl_grpo.py --max-steps 2 --lora             # a LoRA adapter

The data are one-step word problems made here (conversational prompts and an `answer` column);
`correctness` reads that column, `brevity` the completion's length. Each reward call records the
time and the step that sampled it (`trainer_state.global_step`): the script prints the time per
step measured the same way for either library (the first step, start-up, left out).
"""

import argparse
import json
import random
import re
import statistics
import time

import torch
from datasets import Dataset

from periodic_async import GRPOConfig, GRPOTrainer

CALLS: list[tuple[int, float]] = []  # (global_step, time) of each reward call


def correctness(prompts, completions, answer, trainer_state, **kwargs):
    """1.0 when the last number of the completion is the `answer` column."""
    CALLS.append((trainer_state.global_step, time.time()))
    out = []
    for completion, truth in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion[0]["content"].replace(",", ""))
        out.append(1.0 if numbers and numbers[-1] == truth else 0.0)
    return out


def brevity(completions, **kwargs):
    """A small penalty per 100 characters."""
    return [-len(c[0]["content"]) / 100 for c in completions]


def word_problems(n: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, item = rng.choice(["Ava", "Ben", "Cleo", "Dan"]), rng.choice(["apples", "books", "coins"])
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?"
        rows.append({"prompt": [{"role": "user", "content": question + " Give the final answer after ####."}],
                     "answer": str(a + b)})
    return Dataset.from_list(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artifacts/smollm2-135m-instruct",
                   help="made by `python -m periodic_async prepare-model smollm2-135m`")
    p.add_argument("--output-dir", default="runs/trl_grpo")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft_config), as TRL takes it")
    args = p.parse_args(argv)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=1e-5,
        num_generations=args.num_generations, per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        max_completion_length=args.max_completion_length, temperature=0.7, logging_steps=1, report_to="none",
        bf16=False, use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False, seed=0,
        save_strategy="no",
    )
    if args.lora:
        config.learning_rate = 1e-4  # an adapter takes a larger step than the whole model
    trainer = GRPOTrainer(model=args.model, reward_funcs=[correctness, brevity], args=config,
                          train_dataset=word_problems(200), peft_config=peft_config)
    t0 = time.time()
    out = trainer.train()
    total = time.time() - t0
    trainer.save_model(f"{args.output_dir}/final")
    first = {}
    for step, t in CALLS:
        first.setdefault(step, t)
    steps = sorted(first)
    periods = [first[b] - first[a] for a, b in zip(steps[1:], steps[2:])]  # step 0 -> 1 pays start-up
    print(f"global_step={out.global_step} training_loss={out.training_loss:.4f} train_s={total:.1f}")
    print("STEP_TIMES " + json.dumps({"step_s": statistics.median(periods) if periods else None, "periods": periods,
                                      "train_s": total, "global_step": out.global_step}))


if __name__ == "__main__":
    main()
