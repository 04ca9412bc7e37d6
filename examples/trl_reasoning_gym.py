"""GRPO on a reasoning-gym task, a script in TRL's shape: a `datasets.Dataset` built from
reasoning-gym (conversational prompts under its default system prompt), a reward in TRL's
signature that scores each completion with the task's own verifier, GRPOConfig, GRPOTrainer.
It runs on periodic_async's pipeline as written; with the import line below switched to
`from trl import GRPOConfig, GRPOTrainer` it runs on TRL, unchanged otherwise.

    python examples/trl_reasoning_gym.py --model artifacts/smollm2-135m-instruct --max-steps 10
    python examples/trl_reasoning_gym.py --task chain_sum --task-config '{"min_terms": 2, "max_terms": 2}'

The reward is reasoning-gym's `score_answer(extract_answer(completion), entry)` (its partial
credit kept), the entry found by the `task_index` column. A model that never writes the
<answer> tags the system prompt asks for scores 0 everywhere: warm-start it first
(`python -m periodic_async sft` with data.source=reasoning-gym:NAME; docs/usage.md).
"""

import argparse
import json

import reasoning_gym
import torch
from datasets import Dataset
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from periodic_async import GRPOConfig, GRPOTrainer


def task_dataset(task, n: int) -> Dataset:
    """One row per entry of the reasoning-gym dataset `task`: the conversational prompt, the answer,
    and the entry's index (what the reward scores against)."""
    return Dataset.from_list([
        {"prompt": [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
                    {"role": "user", "content": task[i]["question"]}],
         "answer": task[i]["answer"], "task_index": i} for i in range(n)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--task", default="basic_arithmetic", help="a reasoning-gym task name")
    p.add_argument("--task-config", default='{"min_terms": 2, "max_terms": 2, "max_digits": 1}',
                   help="the task's configuration (JSON), passed to reasoning_gym.create_dataset")
    p.add_argument("--train-size", type=int, default=200)
    p.add_argument("--output-dir", default="runs/trl_reasoning_gym")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=64)
    args = p.parse_args()
    task = reasoning_gym.create_dataset(args.task, seed=0, size=args.train_size, **json.loads(args.task_config))

    def task_reward(completions, task_index, **kwargs):
        """reasoning-gym's own score of the answer inside <answer>...</answer> (0 without the tags)."""
        scores = [task.score_answer(extract_answer(c[0]["content"]), task[i]) for c, i in zip(completions, task_index)]
        return [float(s or 0.0) for s in scores]

    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=1e-5,
        num_generations=args.num_generations, per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        max_completion_length=args.max_completion_length, temperature=0.7, logging_steps=1, report_to="none",
        bf16=False, use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False, seed=0,
        save_strategy="no",
    )
    trainer = GRPOTrainer(model=args.model, reward_funcs=[task_reward], args=config,
                          train_dataset=task_dataset(task, args.train_size))
    out = trainer.train()
    trainer.save_model(f"{args.output_dir}/final")
    print(f"global_step={out.global_step} training_loss={out.training_loss:.4f}")


if __name__ == "__main__":
    main()
