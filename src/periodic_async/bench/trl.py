"""The peer baseline of the paper's Table 2: TRL's GRPOTrainer on our model, prompts and reward.

    rows, prompt_len = trl_dataset(cfg, tokenizer)
    result = run_trl(cfg, trl, export_model(cfg, out / "model"), out)   # {"tokens_per_s", ...}

What TRL shares with our runs of the same `RunConfig`: model, tokenizer, prompts (our
iterations' prompts in order, unshuffled: TRL's step t trains on our iteration t's B prompts),
reward functions, B prompts per step, G samples each, max new tokens, temperature / top-p /
top-k, lr, weight decay, beta, clip range, advantage scaling, one optimizer step per
generation batch (steps_per_generation = gradient accumulation, num_iterations = 1). What it
does its own way: one static `generate` of the whole batch in its own process, one row per
response, and the settings in `trl` (the experiment's plan):

    threads              torch threads of the TRL process (its devices, on CPU)
    loss_type            TRL's loss ("dapo": token-mean over the whole batch, as ours)
    micro_batch_tokens   TRL's micro-batch: the largest divisor of B*G whose padded rows fit it
    vllm                 false: TRL generates with `transformers.generate` (system `trl-grpo`);
                         true: with vLLM in its own process (`use_vllm=True, vllm_mode="colocate"`,
                         system `trl-grpo-vllm`), how TRL is usually run
    vllm_kv_cache_gib    the vLLM KV cache of trl-grpo-vllm, in GiB (VLLM_CPU_KVCACHE_SPACE on CPU)

TRL with vLLM, and the one change made to it (`patch_trl_vllm_sync`, applied only in
trl-grpo-vllm's process). TRL 1.16 pushes weights into its colocated vLLM with
`model.load_weights([(name, param)])` on the model inside the engine, once per parameter. On
vLLM's CPU build that call fails at the first push (`'Parameter' object has no attribute
'weight_loader'`: the CPU path repacks linear weights after loading). The patch replaces TRL's
colocate branch of `VLLMGeneration.sync_weights` by vLLM's own reload path,
`model_runner.reload_weights(weights_iterator=...)`, fed by TRL's own parameter iterator
(`_iter_named_params`) plus the tied aliases `state_dict()` names (e.g. `lm_head.weight` tied to
`model.embed_tokens.weight`: sent under one name only, vLLM keeps the old LM head), then
TRL's `reset_prefix_cache()`. Nothing else of TRL changes: generation, scoring, loss and
optimizer are TRL's. Each trl-grpo-vllm run is a fresh process (`python -m
periodic_async.bench.trl`), as is every trl-grpo run, so what TRL allocates, its vLLM engine,
its OpenMP thread binding and its torch.distributed group never touch the benchmark's other
systems.

Trained tokens = sum over samples of (P + R_i), as in our runs. TRL's come from its own log
(`num_tokens`, cumulative); the reward wrapper recounts every batch from the prompt and
completion ids it sees, and `run_trl` raises if the two disagree. tokens/s leaves out the first
optimizer step (start-up), as our runs leave out their first iteration.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from periodic_async.bench.protocol import settings_dict
from periodic_async.config import RunConfig, load_config
from periodic_async.data import few_shot_examples, iteration_prompts, load_examples, prompt_messages
from periodic_async.data.prompts import encode_chat
from periodic_async.reward import combined_reward, load_reward_fn


def export_model(cfg: RunConfig, out: Path) -> Path:
    """Model + tokenizer in one directory: TRL loads both by path (an in-memory model fails).
    Written afresh by every call, so a rebuilt warm start is never read stale."""
    from periodic_async.model import load_policy

    policy, tokenizer = load_policy(cfg.model)
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def trl_dataset(cfg: RunConfig, tokenizer) -> tuple[list[dict], dict[str, int]]:
    """Our iterations' prompts in order (TRL's step t = our iteration t) as TRL rows {prompt:
    chat messages, answer}, and each prompt's token count (keyed by its last message, the problem's user turn)."""
    examples, shots = load_examples(cfg.data, "train"), few_shot_examples(cfg.data)
    rows, prompt_len = [], {}
    for it in range(cfg.trainer.iterations):
        for _, ex in iteration_prompts(examples, it, cfg.algorithm.prompts_per_iteration, cfg.data.seed):
            msgs = prompt_messages(ex, shots, cfg.data)
            prompt_len[msgs[-1]["content"]] = len(encode_chat(tokenizer, msgs))  # the problem's turn: unique
            rows.append({"prompt": msgs, "answer": ex.answer})
    return rows, prompt_len


def trl_micro_batch(cfg: RunConfig, trl: dict, prompt_len: dict[str, int]) -> int:
    """TRL's per_device_train_batch_size: the largest divisor of B*G whose rows, padded to the
    longest prompt + max new tokens (TRL pads to the batch's longest), fit trl['micro_batch_tokens']."""
    n = cfg.algorithm.prompts_per_iteration * cfg.algorithm.group_size
    padded = max(prompt_len.values()) + cfg.engine.max_tokens
    return max(d for d in range(1, n + 1) if n % d == 0 and (d == 1 or d * padded <= trl["micro_batch_tokens"]))


def trl_settings(cfg: RunConfig, trl: dict, tokenizer) -> dict:
    """The settings a benchmark row records for TRL: what it shares with `cfg`, what it does
    instead (its own `generate` of the whole batch, per-response rows) and its own settings."""
    settings = settings_dict(cfg)
    n = cfg.algorithm.prompts_per_iteration * cfg.algorithm.group_size
    backend = "vllm (TRL colocate)" if trl.get("vllm") else "transformers.generate"
    settings["engine"].update(backend=backend, num_workers=1, threads_per_worker=trl["threads"], max_num_seqs=n)
    settings["algorithm"].pop("micro_batch_tokens")  # TRL's own is trl.per_device_train_batch_size
    settings["algorithm"]["shared_prompt"] = False
    settings["pipeline"] = {"mode": "trl-grpo-vllm" if trl.get("vllm") else "trl-grpo"}
    settings["trainer"].update(threads=trl["threads"], threads_after_generation=0)
    _, prompt_len = trl_dataset(cfg, tokenizer)
    settings["trl"] = {**trl, "per_device_train_batch_size": trl_micro_batch(cfg, trl, prompt_len)}
    return settings


def patch_trl_vllm_sync() -> None:
    """THE ONE CHANGE TO TRL (see the module docstring): TRL's colocate weight push goes through
    vLLM's `reload_weights` with every state-dict name, instead of `load_weights`, which fails
    on vLLM's CPU build. Applied in the trl-grpo-vllm process only."""
    from trl.generation import vllm_generation

    original = vllm_generation.VLLMGeneration.sync_weights

    def sync_weights(self):
        if self.mode != "colocate":
            return original(self)
        weights = dict(self._iter_named_params())  # TRL's own iterator (named_parameters: tied once)
        for alias, source in _tied_aliases(self.model).items():
            if source in weights and alias not in weights:
                weights[alias] = weights[source]
        worker = self.llm.llm_engine.model_executor.driver_worker
        runner = getattr(worker, "worker", worker).model_runner
        runner.reload_weights(weights_iterator=iter(weights.items()))
        self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights


def _tied_aliases(model) -> dict[str, str]:
    """{name in state_dict(): the named_parameters() name it shares storage with}, for names that
    named_parameters() leaves out (tied weights, e.g. lm_head.weight -> model.embed_tokens.weight)."""
    by_ptr = {p.data_ptr(): n for n, p in model.named_parameters()}
    named = set(by_ptr.values())
    return {n: by_ptr[t.data_ptr()] for n, t in model.state_dict().items()
            if n not in named and t.data_ptr() in by_ptr}


def run_trl(cfg: RunConfig, trl: dict, model_dir: Path, out_dir: Path) -> dict:
    """One TRL GRPOTrainer run of `cfg.trainer.iterations` optimizer steps on CPU. Returns
    tokens_per_s (from TRL's logged `num_tokens` over steps 2..N), devices (its threads),
    micro_batch, mean_iteration_s and token_check: (TRL's count, our recount) per step. Every
    run happens in a fresh process: what TRL allocates (and vLLM's engine, thread binding and
    process group) is given back when it ends, before the benchmark's next system starts."""
    return _run_trl_in_subprocess(cfg, trl, model_dir, out_dir)


def _run_trl_in_subprocess(cfg: RunConfig, trl: dict, model_dir: Path, out_dir: Path) -> dict:
    """`_run_trl` in a child process (`python -m periodic_async.bench.trl`); its result, or a
    RuntimeError with the end of its output. The vLLM variables only matter with trl['vllm']."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trl_run_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    spec = out_dir / "trl_run.yaml"
    spec.write_text(yaml.safe_dump({"trl": trl, "model_dir": str(model_dir), "out_dir": str(out_dir)}))
    result = out_dir / "trl_result.json"
    result.unlink(missing_ok=True)
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[: int(trl["threads"])])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # TRL reaches the model inside the engine
           "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": str(trl.get("vllm_kv_cache_gib", 2))}
    proc = subprocess.run([sys.executable, "-m", "periodic_async.bench.trl", str(spec)], env=env,
                          capture_output=True, text=True)
    (out_dir / "trl_run.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"TRL run failed (exit {proc.returncode}; log {out_dir / 'trl_run.log'}):\n{tail}")
    return json.loads(result.read_text())


def _run_trl(cfg: RunConfig, trl: dict, model_dir: Path, out_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    a, B, G = cfg.algorithm, cfg.algorithm.prompts_per_iteration, cfg.algorithm.group_size
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows, prompt_len = trl_dataset(cfg, tokenizer)  # counted before the clock starts
    mb = trl_micro_batch(cfg, trl, prompt_len)
    reward_fn = combined_reward([load_reward_fn(f) for f in cfg.reward.functions], cfg.reward.weights)
    recount: list[int] = []  # ours: sum of P + R_i of each generation batch TRL scored

    def reward(prompts, completions, completion_ids, answer, **kwargs):
        recount.append(sum(prompt_len[p[-1]["content"]] + len(c) for p, c in zip(prompts, completion_ids)))
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return reward_fn(prompts, texts, answer=answer)

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_end, self.logged = [], []

        def on_step_end(self, args, state, control, **kw):
            self.step_end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "num_tokens" in logs:
                self.logged.append(int(logs["num_tokens"]))

    steps = B * G // mb
    vllm = bool(trl.get("vllm"))
    if vllm:
        patch_trl_vllm_sync()
    vllm_args = (dict(vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_enable_sleep_mode=False)
                 if vllm else {})
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, use_vllm=vllm, **vllm_args, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=cfg.model.seed, data_seed=cfg.data.seed,
        max_steps=cfg.trainer.iterations, shuffle_dataset=False, dataloader_num_workers=0,
        num_generations=G, per_device_train_batch_size=mb, gradient_accumulation_steps=steps,
        steps_per_generation=steps, num_iterations=1, max_completion_length=cfg.engine.max_tokens,
        temperature=cfg.engine.temperature, top_p=cfg.engine.top_p, top_k=cfg.engine.top_k,
        learning_rate=a.lr, lr_scheduler_type="constant", weight_decay=a.weight_decay, beta=a.beta,
        epsilon=a.eps_low, epsilon_high=a.eps_high, loss_type=trl["loss_type"],
        scale_rewards="group" if a.advantage == "std" else "none", max_grad_norm=a.max_grad_norm,
        gradient_checkpointing=False,  # TRL's default recomputes activations: memory is no issue here
        model_init_kwargs={"dtype": cfg.model.dtype, "attn_implementation": cfg.model.attn_implementation})
    clock = Clock()
    torch.set_num_threads(trl["threads"])
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[clock])
    torch.set_num_threads(trl["threads"])  # vLLM's CPU worker may have set its own
    trainer.train()
    logged, t = clock.logged, clock.step_end
    if len(logged) != cfg.trainer.iterations or len(t) != cfg.trainer.iterations:
        raise RuntimeError(f"TRL logged {len(logged)} num_tokens and {len(t)} steps, expected {cfg.trainer.iterations}")
    per_step = [logged[0]] + [y - x for x, y in zip(logged, logged[1:])]
    if per_step != recount:
        raise AssertionError(f"TRL num_tokens per step {per_step} != our recount of the same batches {recount}")
    seconds = t[-1] - t[0]  # steps 2..N: the first step (start-up) is excluded, as in our runs
    return {"tokens_per_s": sum(per_step[1:]) / seconds, "devices": trl["threads"], "micro_batch": mb,
            "mean_iteration_s": seconds / (len(t) - 1), "token_check": list(zip(per_step, recount))}


def _main(spec_path: str) -> None:
    """The trl-grpo-vllm child: run the spec `_run_trl_in_subprocess` wrote, write its result."""
    spec = yaml.safe_load(Path(spec_path).read_text())
    out_dir = Path(spec["out_dir"])
    cfg = load_config(RunConfig, out_dir / "trl_run_config.yaml")
    result = _run_trl(cfg, spec["trl"], Path(spec["model_dir"]), out_dir)
    (out_dir / "trl_result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])
