"""TRL's GRPO interface on this pipeline: a script written for TRL 1.16's `GRPOTrainer` runs here
with its import line changed.

    from periodic_async import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=[my_reward],
                          args=GRPOConfig(output_dir="out", max_steps=10, num_generations=4), train_dataset=ds)
    trainer.train()
    trainer.save_model("out/final")

What it is: `GRPOConfig` takes TRL's field names (with TRL's defaults) and maps each to a
`RunConfig` (`GRPOConfig.run_config`; the table is docs/trl.md); `GRPOTrainer` turns the dataset
and reward functions into a `pipeline.Task` and runs `pipeline.run`: the producer-consumer
pipeline of the paper (periodic-async by default, the shared prompt on), strictly on-policy.

Guarantees:
- Nothing is silently ignored. A TRL field is either mapped, accepted with no effect here
  (`NO_EFFECT`, each with the reason: the trainer prints the ones a script set), accepted only at
  the value that means what we do (`ONLY_DEFAULT`: another value is refused), or refused
  (`REFUSED`: a feature we lack, accepted at TRL's default, which leaves it off); a name that is
  none of these is refused too. Every refusal is one `ConfigError` line naming the field and why.
  So a config that passes every TRL field at TRL's defaults is taken.
- TRL's defaults mean what they mean in TRL 1.16 / transformers 5 (the schedule, warm-up, save
  and eval intervals, epochs, checkpoints kept, reporting), except the few in `DEFAULTS_DIFFER`,
  each with its reason.
- Under torchrun every rank runs the script, as with TRL; rank 0 alone writes (TRL's
  `is_world_process_zero`) and the other ranks wait for it.
- The data are TRL's: a `prompt` column holding a text (tokenized as it is) or chat messages
  (through the tokenizer's chat template, with the generation prompt); every other column reaches
  the reward functions as TRL passes them.
- The rewards are TRL's: each function is called as TRL calls it, `f(prompts=, completions=,
  completion_ids=, trainer_state=, log_extra=, log_metric=, **columns)`, with `completions` as
  [{"role": "assistant", "content": text}] lists for conversational prompts; a coroutine function
  is awaited; None means "not applicable" (NaN): the weighted sum ignores it, a sample that no
  function scored is left out of its group's baseline and gets advantage 0 (TRL 1.16).
- Tools and environments are TRL's: `GRPOTrainer(tools=, environment_factory=)` (one factory or
  {name: factory} by the rows' `environment` column), `reset(**row)` with the whole row, an
  environment's get_reward() as a reward source of weight 1, `environments=` passed to the reward
  functions, completions as the episode's messages, `max_tool_calling_iterations` and
  `max_completion_length` bounding each episode; environment tokens are out of the loss
  (docs/episodes.md). Each episode is sampled by one policy version, as every group is.
- The loss is TRL's where TRL's is defined on the whole batch ("dapo", "dr_grpo", "grpo"), with its
  bias-corrected KL, its vLLM importance correction (with use_vllm=True) and dapo's normaliser over
  the generation batch at every optimizer step, and the advantages are TRL's ((r - mean_G) /
  (std_G + 1e-4), unbiased std): tests/test_trl_api.py checks both against TRL's own GRPOTrainer on
  one batch.

The rooms: config.py (the TRL field tables, `GRPOConfig`), data.py (dataset and reward adapters),
trainer.py (`GRPOTrainer`); the LoRA settings from TRL's peft_config are lora.py's (`lora.from_peft`).
"""

from periodic_async.trl_api.config import (DEFAULTS_DIFFER, LOSS_TYPES, NO_EFFECT, ONLY_DEFAULT, REFUSED, SCHEDULERS,
                                           GRPOConfig)
from periodic_async.trl_api.data import to_examples, trl_reward
from periodic_async.trl_api.trainer import GRPOTrainer, TrainOutput

__all__ = ["DEFAULTS_DIFFER", "GRPOConfig", "GRPOTrainer", "LOSS_TYPES", "NO_EFFECT", "ONLY_DEFAULT", "REFUSED",
           "SCHEDULERS", "TrainOutput", "to_examples", "trl_reward"]
