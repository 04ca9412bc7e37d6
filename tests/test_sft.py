"""Supervised warm start: a short run lifts held-out accuracy above the untrained model and
saves a model directory the RL runs can load; on tool episodes (sft.episodes) it teaches the
call format an RL episode then uses."""

import json

import torch

from periodic_async.config import SFTRunConfig, load_config
from periodic_async.model import load_policy
from periodic_async.sft import run_sft


def test_short_sft_beats_untrained_model(tokenizer_dir, tmp_path):
    cfg = load_config(SFTRunConfig, None, [
        f"model.tokenizer={tokenizer_dir}", "data.min_steps=1", "data.max_steps=1", "data.max_operand=4",
        "data.num_train=2000", "data.num_eval=40", "sft.max_steps=90", "sft.batch_size=32", "sft.lr=3e-3",
        "sft.warmup_steps=10", "sft.threads=1", f"sft.output_dir={tmp_path / 'sft'}", "logging.wandb_mode=disabled"])
    # sft.threads=1: the suite's other test process keeps the second core busy, and two OpenMP threads
    # beside it trained about 3x slower than one (89 s against 31 s beside a CPU-bound process)
    threads = torch.get_num_threads()  # sft.threads sets torch's: restored for the tests after this one
    try:
        summary = run_sft(cfg)
    finally:
        torch.set_num_threads(threads)
    assert summary["accuracy_before"] == 0.0
    assert summary["accuracy_after"] >= 0.2
    saved = json.loads((tmp_path / "sft" / "sft_summary.json").read_text())
    assert saved["accuracy_after"] == summary["accuracy_after"]
    model, tok = load_policy(cfg.model.__class__(name_or_path=str(tmp_path / "sft")))
    assert tok.eos_token_id is not None and model.config.vocab_size == len(tok)


def test_sft_with_lora_saves_the_merged_model_and_its_adapter(tokenizer_dir, tmp_path):
    """model.lora.enabled: only the adapter trains; the output directory holds the base with the
    adapter merged in (what `model.name_or_path` of an RL run loads), scoring as the trained
    adapter did, and the adapter itself in adapter/ (PEFT's format, which PeftModel loads)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft"
    cfg = load_config(SFTRunConfig, None, [
        f"model.tokenizer={tokenizer_dir}", "model.dtype=float64", "model.lora.enabled=true", "model.lora.rank=4",
        "data.min_steps=1", "data.max_steps=1", "data.max_operand=4", "data.num_train=200", "data.num_eval=4",
        "sft.max_steps=3", "sft.batch_size=4", "sft.lr=1e-2", "sft.warmup_steps=1", "sft.threads=1",
        f"sft.output_dir={out}", "logging.wandb_mode=disabled"])
    threads = torch.get_num_threads()
    try:
        run_sft(cfg)
    finally:
        torch.set_num_threads(threads)
    base, _ = load_policy(cfg.model.__class__(name_or_path=cfg.model.name_or_path, tokenizer=str(tokenizer_dir),
                                              dtype="float64"))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    adapted = PeftModel.from_pretrained(base, out / "adapter")
    ids = torch.tensor([[5, 9, 17, 33, 2, 41, 7]])
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, adapted(input_ids=ids).logits
        plain = adapted.get_base_model()
        with adapted.disable_adapter():
            c = plain(input_ids=ids).logits
    # 1e-6: PeftModel.from_pretrained builds its LoRA layers in float32 on this float64 base
    assert (a - b).abs().max() < 1e-6, "the merged model scores as base + adapter"
    assert (a - c).abs().max() > 1e-6, "the adapter trained"


def _episode(question: str, expression: str, result: str) -> dict:
    """A finished tool episode in TRL's conversational format."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "calculator", "content": result},
                         {"role": "assistant", "content": f"<answer>{result}</answer>"}]}


def test_sft_on_tool_episodes_teaches_the_call(tokenizer_dir, tmp_path):
    """`sft.episodes`: a JSONL of tool episodes trains the model's turns (the tool's answer is
    context); the warm-started model, run as an RL episode would be (greedy, the calculator
    environment, the plain-text format), calls the calculator with the taught expression, reads
    its answer and answers right. The untrained model does not."""
    import asyncio

    from periodic_async.config import ModelConfig
    from periodic_async.engine import SamplingParams
    from periodic_async.engine.local import LocalEngine
    from periodic_async.episode import EpisodeLimits, EpisodeRunner, GroupSpec, FeedContinuer
    from periodic_async.episode.envs import CalculatorEnv, Latency
    from periodic_async.episode.protocol import Environments

    data = tmp_path / "episodes.jsonl"
    data.write_text("".join(json.dumps(_episode(q, e, r)) + "\n" for q, e, r in
                            [("What is 3+4?", "3+4", "7"), ("What is 6*7?", "6*7", "42")]))
    out = tmp_path / "sft"
    cfg = load_config(SFTRunConfig, None, [
        f"model.tokenizer={tokenizer_dir}", "model.name_or_path=qwen2-micro", f"sft.episodes={data}",
        "env.factory=periodic_async.episode.envs:CalculatorEnv", "env.tool_format=plain", "sft.max_steps=200",
        "sft.batch_size=2", "sft.lr=1e-2", "sft.warmup_steps=1", "sft.threads=1", f"sft.output_dir={out}",
        "logging.wandb_mode=disabled"])
    threads = torch.get_num_threads()
    try:
        summary = run_sft(cfg)
    finally:
        torch.set_num_threads(threads)
    assert summary["final_loss"] < 0.05 and summary["eval_n"] == 0

    def episode(model_dir: str):
        policy, tok = load_policy(ModelConfig(name_or_path=model_dir, tokenizer=str(tokenizer_dir)))
        envs = Environments(CalculatorEnv.factory(latency=Latency(scale=0.01)))
        with FeedContinuer(LocalEngine(policy.eval(), tok, max_num_seqs=2)) as cont:
            runner = EpisodeRunner(tok, cont, envs, SamplingParams(max_tokens=80, temperature=0.0),
                                   EpisodeLimits(max_turns=3, max_tokens=300, max_turn_tokens=80), tool_format="plain")
            spec = GroupSpec(0, [{"role": "user", "content": "What is 6*7?"}], {"answer": "42"}, 1, 0, "t")
            return asyncio.run(runner.run_group(spec))[0]

    taught = episode(str(out))
    assert taught.messages[0]["tool_calls"][0]["function"]["arguments"] == {"expression": "6*7"}
    assert (taught.tool_calls, taught.env_reward) == (1, 1.0)
    assert episode("qwen2-micro").tool_calls == 0


def test_sft_episodes_bad_rows_are_one_line(tokenizer_dir, tmp_path):
    """A row without `messages`, or a conversation without an assistant turn, names the file and line."""
    import pytest

    from periodic_async.config import ConfigError

    for row, words in [({"prompt": "x"}, "needs a 'messages' list"),
                       ({"messages": [{"role": "user", "content": "x"}]}, "needs its prompt")]:
        data = tmp_path / "episodes.jsonl"
        data.write_text(json.dumps(_episode("q", "1+1", "2")) + "\n" + json.dumps(row) + "\n")
        cfg = load_config(SFTRunConfig, None, [
            f"model.tokenizer={tokenizer_dir}", "model.name_or_path=qwen2-micro", f"sft.episodes={data}",
            "env.tool_format=plain", "sft.max_steps=1", f"sft.output_dir={tmp_path / 'sft'}",
            "logging.wandb_mode=disabled"])
        with pytest.raises(ConfigError, match=rf"sft.episodes: {data}:2: .*{words}"):
            run_sft(cfg)
