"""LoRA (`model.lora`, through peft): only the adapters train; the tri-model holds the base once
(ref = the base with the adapter disabled, old = a copy of the adapter tensors alone) and its three
log-probs are exact (fp64: ref = an independently loaded plain base model, old = the policy at the
iteration start, shared-prompt packing = per-response packing); the KL gradient reaches only the
adapter; the trainer pushes the adapter alone; checkpoints hold the merged policy (a plain model
directory) and the adapter (a peft directory), and a resume continues exactly; bad settings are one
line naming the field."""

import copy
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from periodic_async import checkpoint, grpo  # noqa: E402
from periodic_async.batching import split_groups  # noqa: E402
from periodic_async.config import (AlgorithmConfig, ConfigError, LoRAConfig, ModelConfig, RunConfig,  # noqa: E402
                                   load_config)
from periodic_async.consumer import Consumer  # noqa: E402
from periodic_async.group import Group  # noqa: E402
from periodic_async.lora import apply_lora, is_lora, merge_lora  # noqa: E402
from periodic_async.model import build_model, load_policy  # noqa: E402
from periodic_async.shared_prompt import token_logprobs  # noqa: E402
from periodic_async.trimodel import TriModel  # noqa: E402

LORA = dict(enabled=True, rank=4, alpha=8.0)


def model_cfg(preset: str = "qwen2-1m", dtype: str = "float64", **lora) -> ModelConfig:
    return ModelConfig(name_or_path=preset, dtype=dtype, device="cpu", seed=0, lora=LoRAConfig(**{**LORA, **lora}))


def lora_policy(tokenizer, preset: str = "qwen2-1m", dtype: str = "float64", moved: bool = True, **lora):
    """A LoRA policy on a preset; `moved`: its lora_B set to small random values (peft starts them
    at zero, where the adapter would change nothing and every comparison would be vacuous)."""
    cfg = model_cfg(preset, dtype, **lora)
    policy = apply_lora(build_model(cfg, tokenizer), cfg.lora, seed=cfg.seed)
    if moved:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return policy


def make_groups(vocab: int, version: int = 0, seed: int = 0, n: int = 3) -> list[Group]:
    """`n` groups (G = 3) with ragged responses and distinct rewards."""
    rng = random.Random(seed)
    groups = []
    for b in range(n):
        responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(2, 7))] for _ in range(3)]
        rewards = [1.0, 0.0, 0.5]
        groups.append(Group(b, version, version, [rng.randrange(4, vocab) for _ in range(6)], responses,
                            [[-1.0] * len(r) for r in responses], rewards, grpo.group_advantages(rewards).tolist()))
    return groups


def inputs_of(groups, shared: bool = True, budget: int = 24):
    return [mb.build(shared=shared, dtype=torch.float64)
            for mb in split_groups(groups, max_tokens=budget, groups_per_micro_batch=2, shared=shared)]


def cfg_of(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(**{"lr": 1e-2, "max_grad_norm": 0.0, **kw})


def adapter_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def base_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def run_step(tri: TriModel, mbs, opt) -> dict:
    acc = grpo.LossAccumulator.from_config(tri.cfg)
    for inp in mbs:
        tri.micro_step(inp, acc)
    return tri.optimizer_step(opt, acc)


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("override,field", [("model.lora.rank=0", "model.lora.rank=0"),
                                            ("model.lora.rank=-2", "model.lora.rank=-2"),
                                            ("model.lora.dropout=1", "model.lora.dropout=1.0"),
                                            ("model.lora.dropout=-0.1", "model.lora.dropout=-0.1"),
                                            ("model.lora.target_modules=[]", "model.lora.target_modules=[]"),
                                            ("model.lora.push=full", "model.lora.push")])
def test_bad_lora_settings_are_one_line(override, field):
    """rank <= 0, dropout outside [0, 1), no target module, a push that is neither the adapter nor
    the merged weights: one ConfigError line naming the field."""
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, None, ["model.lora.enabled=true", override])
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_missing_target_module_is_one_line(tokenizer_dir):
    """A target module the model does not have: one line naming the field, the module and the
    model's linear modules; nothing is built."""
    cfg = load_config(RunConfig, None, [f"model.tokenizer={tokenizer_dir}", "model.name_or_path=qwen2-micro",
                                        "model.lora.enabled=true", "model.lora.target_modules=[q_proj, qkv_proj]"])
    with pytest.raises(ConfigError) as e:
        load_policy(cfg.model)
    msg = str(e.value)
    assert msg.startswith("model.lora.target_modules=['q_proj', 'qkv_proj']") and "\n" not in msg
    assert "qkv_proj" in msg and "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in msg


def test_lora_is_off_by_default(tokenizer_dir):
    """Without model.lora.enabled the policy is the plain model (the full model trains)."""
    cfg = load_config(RunConfig, None, [f"model.tokenizer={tokenizer_dir}", "model.name_or_path=qwen2-micro"])
    assert not cfg.model.lora.enabled
    assert not is_lora(load_policy(cfg.model)[0])


# --- the policy --------------------------------------------------------------------------------


def run_cfg(tokenizer_dir, **overrides) -> RunConfig:
    base = {"model.name_or_path": "qwen2-1m", "model.tokenizer": str(tokenizer_dir), "model.device": "cpu",
            "model.dtype": "float64", "model.lora.enabled": "true", "model.lora.rank": 4, "model.lora.alpha": 8,
            "algorithm.group_size": 3, "algorithm.prompts_per_iteration": 3, "algorithm.micro_batch_tokens": 24,
            "algorithm.attention_backend": "split", "algorithm.lr": 1e-2, "algorithm.beta": 0.1,
            "trainer.iterations": 3}
    base.update(overrides)
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in base.items()])


def test_only_the_adapter_trains_in_mixed_precision(tokenizer_dir, tokenizer):
    """model.dtype=bfloat16 with LoRA: the frozen base stays bfloat16 (no float32 copy), the adapters
    are the float32 masters and the optimizer holds them alone; an iteration moves every adapter
    tensor's B and leaves every base weight bit-identical."""
    cfg = run_cfg(tokenizer_dir, **{"model.dtype": "bfloat16", "algorithm.lr": 1e-3})
    policy, _ = load_policy(cfg.model)
    assert is_lora(policy)
    consumer = Consumer(policy, cfg)
    base, adapter = base_of(policy), adapter_of(policy)
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    assert all(t.dtype == torch.bfloat16 for t in base.values())
    assert all(t.dtype == torch.float32 for t in adapter.values())
    held = {id(p) for g in consumer.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in trainable(policy)}
    assert consumer.tri.autocast_dtype == torch.bfloat16
    consumer.train_iteration(make_groups(len(tokenizer)), 0, 0)
    assert all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if n in base)
    moved = adapter_of(policy)
    assert all(not torch.equal(moved[n], adapter[n]) for n in adapter if ".lora_B." in n)


def test_shared_prompt_packing_matches_per_response_through_the_adapter(tokenizer):
    """After one optimizer step (policy, old and ref all differ), the policy, old and ref
    log-probs and the adapter gradient are the same with the shared-prompt layout as with one
    segment per response, and however cut into micro-batches (fp64, atol 1e-10), through the
    PeftModel (llama-micro: SmolLM2's architecture down-scaled)."""
    groups = make_groups(len(tokenizer))
    tri = TriModel(lora_policy(tokenizer, "llama-micro"),
                   cfg_of(beta=0.1, skip_old_forward=True, optimizer_steps_per_iteration=2))
    assert tri.lora and tri.old is not None and tri.ref is None
    run_step(tri, inputs_of(groups), torch.optim.SGD(trainable(tri.policy), lr=0.5))
    results = []
    for shared, budget in ((True, 24), (False, 24), (False, 0)):
        logps = {k: [] for k in ("labels", "policy", "old", "ref")}
        acc = grpo.LossAccumulator.from_config(tri.cfg)
        for inp in inputs_of(groups, shared, budget):
            out = tri.forward(inp.packed)
            for k, v in (("labels", inp.packed.labels_N), ("policy", out.policy_N), ("old", out.old_N),
                         ("ref", out.ref_N)):
                logps[k].extend(v.detach().tolist())
            tri.micro_step(inp, acc)
        acc.finalize_gradients(trainable(tri.policy))
        grads = {n: p.grad.clone() for n, p in tri.policy.named_parameters() if p.requires_grad}
        tri.policy.zero_grad(set_to_none=True)
        results.append((logps, grads, acc.metrics()))
    (want, want_grads, want_metrics), *others = results
    assert want_metrics["kl"] > 1e-6
    assert not torch.allclose(torch.tensor(want["policy"]), torch.tensor(want["old"]), atol=1e-6)
    for logps, grads, metrics in others:
        assert logps["labels"] == want["labels"]
        for k in ("policy", "old", "ref"):
            torch.testing.assert_close(torch.tensor(logps[k]), torch.tensor(want[k]), rtol=0, atol=1e-10)
        for n, g in grads.items():
            torch.testing.assert_close(g, want_grads[n], rtol=0, atol=1e-10, msg=lambda m: f"{n}: {m}")


# --- the tri-model: ref, old, the KL gradient, memory ---------------------------------------------


def test_reference_is_the_base_model(tokenizer):
    """beta > 0 with LoRA: no copy of the weights is made for the reference, and its log-probs are
    those of the plain base model loaded independently from the same settings (fp64, equal to the
    last bit: a disabled LoRA layer runs its base layer alone), while the policy's differ."""
    cfg = model_cfg()
    tri = TriModel(lora_policy(tokenizer), cfg_of(beta=0.1))
    plain = build_model(ModelConfig(name_or_path=cfg.name_or_path, dtype="float64", device="cpu", seed=cfg.seed),
                        tokenizer)
    for inp in inputs_of(make_groups(len(tokenizer))):
        out = tri.forward(inp.packed)
        with torch.no_grad():
            want = token_logprobs(plain, inp.packed, backend="auto")
        assert torch.equal(out.ref_N, want)
        assert (out.policy_N.detach() - want).abs().max() > 1e-4, "the adapter must change the policy"


def test_old_is_the_policy_at_the_iteration_start(tokenizer):
    """Two optimizer steps in one iteration: old keeps the adapter of the iteration start (its
    log-probs equal the policy's then, exactly) while the policy moves; `refresh_old` copies the
    adapter tensors alone, in place, and never touches the shared base."""
    tri = TriModel(lora_policy(tokenizer), cfg_of(beta=0.1, skip_old_forward=False, optimizer_steps_per_iteration=2))
    assert set(tri.old) == set(adapter_of(tri.policy)), "old holds the adapter tensors alone"
    mbs = inputs_of(make_groups(len(tokenizer)))
    start = [tri.forward(inp.packed).policy_N.detach() for inp in mbs]
    base = base_of(tri.policy)
    opt = torch.optim.SGD(trainable(tri.policy), lr=0.5)
    for _ in range(2):
        run_step(tri, mbs, opt)
        for inp, want in zip(mbs, start):
            out = tri.forward(inp.packed)
            assert torch.equal(out.old_N, want)
            assert (out.policy_N.detach() - want).abs().max() > 1e-6
    ptrs = {n: t.data_ptr() for n, t in tri.old.items()}
    tri.refresh_old()  # the barrier
    assert {n: t.data_ptr() for n, t in tri.old.items()} == ptrs
    assert all(torch.equal(tri.old[n], p) for n, p in adapter_of(tri.policy).items())
    assert all(torch.equal(p, base[n]) for n, p in base_of(tri.policy).items())
    for inp in mbs:
        out = tri.forward(inp.packed)
        assert torch.equal(out.old_N, out.policy_N.detach())


def test_kl_gradient_reaches_only_the_adapter(tokenizer):
    """Zero advantages leave the k3 KL to the reference as the whole loss: its gradient is nonzero
    on the adapter and reaches no base weight (no .grad at all)."""
    groups = make_groups(len(tokenizer))
    for g in groups:
        g.advantages = [0.0] * len(g.advantages)
    tri = TriModel(lora_policy(tokenizer), cfg_of(beta=1.0))
    acc = grpo.LossAccumulator.from_config(tri.cfg)
    for inp in inputs_of(groups):
        tri.micro_step(inp, acc)
    assert acc.metrics()["kl"] > 1e-6
    assert all(p.grad is None for p in tri.policy.parameters() if not p.requires_grad)
    grads = [p.grad for p in trainable(tri.policy)]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 1e-6


def test_memory_holds_the_base_once(tokenizer):
    """qwen2-1m (float32), LoRA rank 4 on every linear module, with both an old copy and a
    reference: the tri-model's weights are the base once plus two adapter copies, at most 1.1x one
    plain model (the full-weight tri-model holds three models: 3x)."""
    plain = TriModel(build_model(ModelConfig(name_or_path="qwen2-1m", device="cpu"), tokenizer),
                     cfg_of(beta=0.1, skip_old_forward=False))
    one = plain.memory()["policy_bytes"]
    assert plain.memory()["total_bytes"] == 3 * one
    tri = TriModel(lora_policy(tokenizer, dtype="float32", moved=False), cfg_of(beta=0.1, skip_old_forward=False))
    m = tri.memory()
    adapter = sum(t.numel() * t.element_size() for t in adapter_of(tri.policy).values())
    assert m["ref_bytes"] == 0 and m["old_bytes"] == adapter
    assert m["policy_bytes"] == one + adapter
    print(f"[memory] plain model {one} B; LoRA tri-model {m} = {m['total_bytes'] / one:.3f}x one model "
          f"(full tri-model: 3x)")
    assert m["total_bytes"] <= 1.1 * one


# --- what leaves the trainer: the push, the checkpoint ---------------------------------------------


def test_engine_state_dict_is_the_adapter(tokenizer_dir):
    """The push with LoRA: the adapter tensors alone, named as peft's get_peft_model_state_dict names
    them, on the CPU, copies (a change to them leaves the policy alone)."""
    from peft import get_peft_model_state_dict

    cfg = run_cfg(tokenizer_dir)
    policy, _ = load_policy(cfg.model)
    consumer = Consumer(policy, cfg)
    pushed = consumer.engine_state_dict()
    want = get_peft_model_state_dict(policy)
    assert set(pushed) == set(want) and len(pushed) == len(adapter_of(policy))
    assert all(n.startswith("base_model.model.") and (".lora_A.weight" in n or ".lora_B.weight" in n) for n in pushed)
    for n, t in pushed.items():
        assert t.device.type == "cpu" and t.dtype == torch.float64 and torch.equal(t, want[n])
        t.add_(1.0)
    assert all(not torch.equal(pushed[n], t) for n, t in get_peft_model_state_dict(policy).items())


def test_merged_weights_equal_peft_merge(tokenizer):
    """The merged policy (`lora.merge_lora`: a checkpoint's model, a merged push) is peft's
    merge_and_unload, and leaves the policy as it was."""
    policy = lora_policy(tokenizer)
    before = {n: t.clone() for n, t in policy.state_dict().items()}
    merged = merge_lora(policy, policy.state_dict())
    want = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert set(merged) == set(want)
    for n, t in want.items():
        torch.testing.assert_close(merged[n], t, rtol=0, atol=1e-14, msg=lambda m: f"{n}: {m}")
    assert all(torch.equal(t, before[n]) for n, t in policy.state_dict().items())
    assert any(not torch.equal(merged[n], t) for n, t in build_model(model_cfg(), tokenizer).state_dict().items())


def logprobs_of(model, groups) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([token_logprobs(model, inp.packed) for inp in inputs_of(groups)])


def test_checkpoint_resume_is_exact(tokenizer_dir, tokenizer, tmp_path):
    """A consumer trains iterations 0 and 1; another is built fresh, loads the checkpoint written
    after iteration 0 (adapter, optimizer, scheduler, RNG) and trains iteration 1: the same adapter
    to the last bit (fp64), the base untouched. The checkpoint directory is a plain model directory
    holding the merged policy (its log-probs are the policy's) and `adapter/` is a peft directory
    (`PeftModel.from_pretrained(base, ...)` gives the policy's log-probs)."""
    from peft import PeftModel

    cfg = run_cfg(tokenizer_dir, **{"algorithm.skip_old_forward": "false", "trainer.output_dir": str(tmp_path)})
    iterations = [make_groups(len(tokenizer), version=t, seed=t) for t in range(2)]
    policy, tok = load_policy(cfg.model)
    reference = checkpoint.reference_hash(policy)
    consumer = Consumer(policy, cfg)
    consumer.train_iteration(iterations[0], 0, 0)
    ckpt = checkpoint.save(tmp_path, 1, policy, tok, consumer, cfg, reference=reference)
    rng_then = torch.rand(3)  # the first draw after the save
    after_0 = logprobs_of(policy, iterations[1])
    consumer.train_iteration(iterations[1], 1, 1)
    want = adapter_of(policy)

    assert {p.name for p in (ckpt / checkpoint.ADAPTER).iterdir()} >= {"adapter_config.json",
                                                                       "adapter_model.safetensors"}
    merged = build_model(ModelConfig(name_or_path=str(ckpt), dtype="float64", device="cpu"), tokenizer)  # as
    assert not is_lora(merged)  # model.name_or_path=<run>/checkpoint loads it: a plain model
    torch.testing.assert_close(logprobs_of(merged, iterations[1]), after_0, rtol=0, atol=1e-10)
    base = build_model(cfg.model, tokenizer)
    loaded = PeftModel.from_pretrained(base, ckpt / checkpoint.ADAPTER)
    torch.testing.assert_close(logprobs_of(loaded, iterations[1]), after_0, rtol=0, atol=1e-12)

    fresh, _ = load_policy(cfg.model)
    base_0 = base_of(fresh)
    resumed = Consumer(fresh, cfg)
    torch.manual_seed(7)
    assert checkpoint.load(ckpt, fresh, resumed, cfg, reference) == 1 and resumed.version == 1
    assert torch.equal(torch.rand(3), rng_then)  # the RNG restored
    resumed.train_iteration(iterations[1], 1, 1)
    got = adapter_of(fresh)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert all(torch.equal(p, base_0[n]) for n, p in base_of(fresh).items())
    # other LoRA settings (another scaling alpha / rank, or no LoRA) are refused by name, before anything loads
    for change in ({"model.lora.alpha": 16}, {"model.lora.enabled": "false"}):
        other = run_cfg(tokenizer_dir, **change)
        policy, _ = load_policy(other.model)
        with pytest.raises(ValueError, match=r"was trained with model.lora=\{'enabled': True, 'rank': 4, 'alpha': 8.0"):
            checkpoint.load(ckpt, policy, Consumer(policy, other), other, checkpoint.reference_hash(policy))


# --- trainer ranks -------------------------------------------------------------------------------


def _ranks_cfg(tokenizer_dir, parallel: str = "ddp") -> RunConfig:
    """test_distributed's trainer-ranks run (qwen2-micro, fp64, beta 0.05, old kept) with LoRA."""
    from test_distributed import _cfg

    return _cfg(tokenizer_dir, parallel, **{"model.lora.enabled": "true", "model.lora.rank": 4, "model.lora.alpha": 8,
                                            "model.lora.target_modules": "[q_proj, v_proj, up_proj]"})


def _merged_push(cfg: RunConfig) -> RunConfig:
    """`cfg` with model.lora.push='merged' (what a consumer's engine_state_dict reads)."""
    import dataclasses

    lora = dataclasses.replace(cfg.model.lora, push="merged")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=lora))


def _lora_ranks(rank: int, world: int, port: int, tokenizer_dir: str, parallel: str, out: str) -> None:
    """One trainer rank: LoRA training over test_distributed's PLAN (uneven shares, an empty one), a
    checkpoint after iteration 0 (collective), then a fresh policy resumed from it trains iteration 1."""
    from test_distributed import PLAN, _groups, _join_ranks

    from periodic_async.parallel.distributed import init_ranks

    _join_ranks(rank, world, port)
    cfg = _ranks_cfg(tokenizer_dir, parallel)
    ranks = init_ranks(cfg)
    result = {}
    for leg in ("full", "resumed"):
        policy, tok = load_policy(cfg.model)
        consumer = Consumer(policy, cfg, ranks=ranks)
        first = 0
        if leg == "resumed":
            first = checkpoint.load(Path(out) / "checkpoint-1" if rank == 0 else None, policy, consumer, cfg)
        ranks.start(consumer, first)
        for iteration in range(first, len(PLAN)):
            groups = _groups(policy.config.vocab_size, iteration)
            consumer.train_iteration([groups[i] for i in PLAN[iteration][rank]], iteration, iteration)
            if leg == "full" and iteration == 0:
                checkpoint.save(Path(out), 1, policy, tok, consumer, cfg)
        result[leg] = consumer.engine_state_dict()  # fsdp: gathered (every rank joins)
    consumer.cfg = _merged_push(cfg)
    result["merged"] = consumer.engine_state_dict()  # fsdp: the whole model gathered, then merged
    torch.save(result, Path(out) / f"rank{rank}.pt")
    ranks.close()


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_trainer_ranks_train_the_adapter_as_one_process(tokenizer_dir, tmp_path, parallel):
    """2 gloo ranks with LoRA (ddp; fsdp: FSDP2 shards base and adapters alike): uneven and empty
    shares of two iterations give the single-process adapter (fp64, <= 1e-10), and so does a fresh
    pair of ranks resumed from the checkpoint the ranks wrote after iteration 0; with
    model.lora.push='merged' every rank's push is the single process's merged model."""
    from test_distributed import PLAN, RankPool, _free_port, _groups

    pool = RankPool()
    try:
        pool.run(_lora_ranks, (2, _free_port(), str(tokenizer_dir), parallel, str(tmp_path)))
    finally:
        pool.close()
    cfg = _ranks_cfg(tokenizer_dir, "ddp")
    policy, _ = load_policy(cfg.model)
    start = {n: t.clone() for n, t in Consumer(policy, cfg).engine_state_dict().items()}
    consumer = Consumer(policy, cfg)
    for iteration in range(len(PLAN)):
        consumer.train_iteration(_groups(policy.config.vocab_size, iteration), iteration, iteration)
    want = consumer.engine_state_dict()
    consumer.cfg = _merged_push(cfg)
    merged = consumer.engine_state_dict()
    assert max((want[n] - start[n]).abs().max().item() for n in want) > 1e-3, "training must move the adapter"
    assert not any("lora_" in n for n in merged) and len(merged) > len(want)
    assert (tmp_path / "checkpoint-1" / checkpoint.ADAPTER / "adapter_model.safetensors").is_file()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for leg in ("full", "resumed"):
            assert got[leg].keys() == want.keys()
            assert max((got[leg][n] - want[n]).abs().max().item() for n in want) <= 1e-10, (rank, leg)
        assert got["merged"].keys() == merged.keys()
        assert max((got["merged"][n] - merged[n]).abs().max().item() for n in merged) <= 1e-10, rank


# --- whole runs: the equivalence claim and exact resume with LoRA ------------------------------------


def _run_cfg(out: Path, tokenizer_dir, **extra) -> RunConfig:
    """conftest's tiny run (qwen2-1m, fp64, beta 0.05) with LoRA rank 4 on every linear module, the
    in-process built-in engine (lock-step workers: its completion order is the machine's, not the
    timing's), a checkpoint after every iteration."""
    from helpers import tiny_run_config

    return tiny_run_config(out, tokenizer_dir, **{
        "engine.backend": "local", "model.lora.enabled": "true", "model.lora.rank": 4, "model.lora.alpha": 16,
        "algorithm.lr": 2e-2, "trainer.save_every": 1, "trainer.keep_last": 3, **extra})


def _adapter_files(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(ckpt) / checkpoint.ADAPTER / "adapter_model.safetensors")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def lora_engine(tokenizer_dir, tmp_path_factory):
    from periodic_async.engine import make_engine

    cfg = _run_cfg(tmp_path_factory.mktemp("e"), tokenizer_dir)
    with make_engine(cfg.engine, cfg.model, backend="local") as eng:
        yield eng


@pytest.fixture(scope="module")
def lora_sync(lora_engine, tokenizer_dir, tmp_path_factory) -> RunConfig:
    """The synchronous LoRA run (sync-separated), 3 iterations."""
    from periodic_async.pipeline import run

    cfg = _run_cfg(tmp_path_factory.mktemp("sync"), tokenizer_dir, **{"pipeline.mode": "sync-separated"})
    run(cfg, engine=lora_engine)
    return cfg


def test_async_matches_sync_with_lora(lora_engine, lora_sync, tokenizer_dir, tmp_path):
    """The paper's equivalence claim with LoRA: periodic-async samples the synchronous run's tokens
    and rewards in every iteration and ends on its adapter and merged weights (fp64, <= 1e-10),
    although it trained the groups in another order; training moved the adapter."""
    from helpers import by_prompt, checkpoint_weights, read_rollouts

    from periodic_async.pipeline import run

    asyn = _run_cfg(tmp_path, tokenizer_dir, **{"pipeline.mode": "periodic-async"})
    run(asyn, engine=lora_engine)
    rs, ra = read_rollouts(lora_sync.trainer.output_dir), read_rollouts(tmp_path)
    assert len(rs) == len(ra) == 3 * 6 and by_prompt(rs) == by_prompt(ra)
    assert any(r["rewards"] != rs[0]["rewards"] for r in rs), "rewards must vary, or the test proves nothing"
    assert [r["position"] for r in ra] != [r["position"] for r in rs], "async must train in another order"
    from peft import get_peft_model_state_dict

    from periodic_async.trace import read_jsonl

    sync_dir = Path(lora_sync.trainer.output_dir)
    want = _adapter_files(sync_dir / "checkpoint")
    assert _max_diff(want, get_peft_model_state_dict(load_policy(lora_sync.model)[0])) > 1e-3
    # the engine sampled with the pushed adapters: its log-probs of the sampled tokens are the trainer's
    # (~1.6e-7 here, as in the same run without LoRA: the engines report float32 log-probs)
    gaps = [m["train/behaviour_logp_gap"] for m in read_jsonl(tmp_path / "metrics.jsonl")
            if "train/behaviour_logp_gap" in m]
    assert len(gaps) == 3 and max(gaps) < 1e-6
    assert _max_diff(_adapter_files(tmp_path / "checkpoint"), want) <= 1e-10
    assert _max_diff(checkpoint_weights(tmp_path / "checkpoint"), checkpoint_weights(sync_dir / "checkpoint")) <= 1e-10


def test_extra_optimizer_step_breaks_equivalence_with_lora(lora_engine, tokenizer_dir, tmp_path):
    """Negative control: two optimizer steps per iteration (mini-batches in completion order) and
    the two modes leave iteration 0 with different adapters."""
    from helpers import read_rollouts

    from periodic_async.pipeline import run

    extra = {"algorithm.optimizer_steps_per_iteration": 2, "trainer.iterations": 1}
    cfgs = [_run_cfg(tmp_path / m, tokenizer_dir, **{"pipeline.mode": m, **extra})
            for m in ("sync-separated", "periodic-async")]
    for cfg in cfgs:
        run(cfg, engine=lora_engine)
    first_half = [{r["prompt_index"] for r in read_rollouts(c.trainer.output_dir)[:3]} for c in cfgs]
    assert first_half[0] != first_half[1], "orders must differ for a fair control"
    got = [_adapter_files(Path(c.trainer.output_dir) / "checkpoint") for c in cfgs]
    assert _max_diff(*got) > 1e-6


def test_resume_matches_uninterrupted_with_lora(lora_engine, lora_sync, tokenizer_dir, tmp_path):
    """A LoRA run stopped after 2 iterations and resumed (trainer.resume=auto) samples the
    uninterrupted run's tokens in iteration 2 and ends on its adapter and merged weights (fp64,
    <= 1e-10); its checkpoint-2 is the uninterrupted run's."""
    from helpers import by_prompt, checkpoint_weights, read_rollouts

    from periodic_async.pipeline import run

    full = Path(lora_sync.trainer.output_dir)
    mode = {"pipeline.mode": "sync-separated"}
    run(_run_cfg(tmp_path, tokenizer_dir, **mode, **{"trainer.iterations": 2}), engine=lora_engine)
    assert _max_diff(_adapter_files(tmp_path / "checkpoint-2"), _adapter_files(full / "checkpoint-2")) <= 1e-10
    run(_run_cfg(tmp_path, tokenizer_dir, **mode, **{"trainer.resume": "auto"}), engine=lora_engine)
    assert checkpoint.latest(tmp_path).name == "checkpoint-3"
    assert by_prompt(read_rollouts(tmp_path)) == by_prompt(read_rollouts(full))
    assert _max_diff(_adapter_files(tmp_path / "checkpoint-3"), _adapter_files(full / "checkpoint-3")) <= 1e-10
    assert _max_diff(checkpoint_weights(tmp_path / "checkpoint-3"), checkpoint_weights(full / "checkpoint-3")) <= 1e-10
