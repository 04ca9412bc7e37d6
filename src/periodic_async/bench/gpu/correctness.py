"""The check's first step, `correctness`: the paper's claims on the device before any speed
(the package docstring lists the five checks); correctness.csv, one row per check and setting."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from periodic_async import pipeline
from periodic_async import shared_prompt as sp
from periodic_async.bench.gpu.common import Budget, Sizes, Table, backends_for, failure, random_group
from periodic_async.bench.gpu.models import arch_model, tokenizer_at
from periodic_async.config import RunConfig, load_config
from periodic_async.engine import make_engine
from periodic_async.engine.local import LocalEngine
from periodic_async.engine.verify import default_atol, model_logprobs, probe_tokens
from periodic_async.shared_prompt import pack, resolve_backend, token_logprobs
from periodic_async.trace import read_jsonl


def diversity_reward(prompts, completions, **kwargs) -> list[float]:
    """A reward an untrained model varies on (distinct characters), so advantages are not zero."""
    return [len(set(c)) / 10.0 for c in completions]

def run_config(out: Path, tokenizer_dir: Path, preset: str, device: str, dtype: str, mode: str, iterations: int,
               prompts: int, group: int, max_tokens: int, **extra):
    """A short training run: `preset` with random weights, the in-process engine, the diversity reward."""
    settings = {
        "model.name_or_path": preset, "model.tokenizer": str(tokenizer_dir), "model.dtype": dtype, "model.seed": 3,
        "model.device": device, "data.num_train": 64, "data.num_eval": 0, "data.seed": 5,
        "reward.functions": "periodic_async.bench.gpu.correctness:diversity_reward", "reward.timeout_s": 0,
        "engine.backend": "local", "engine.max_num_seqs": prompts * group, "engine.max_tokens": max_tokens,
        "engine.stop": "e", "engine.cpu_affinity": "off",
        "algorithm.group_size": group, "algorithm.prompts_per_iteration": prompts, "algorithm.lr": 3e-3,
        "algorithm.micro_batch_tokens": 120, "algorithm.beta": 0.05,
        "trainer.iterations": iterations, "trainer.output_dir": str(out), "trainer.eval_at_end": False,
        "trainer.threads": 1, "trainer.threads_after_generation": 0, "trainer.cpu_affinity": "off",
        "pipeline.mode": mode, "logging.wandb_mode": "disabled", "logging.progress": False, "logging.trace": False,
        **extra}
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in settings.items()])


def read_run(out: Path) -> tuple[dict, dict, list[dict]]:
    """(samples by (iteration, prompt), final weights, metrics lines) of a finished run."""
    rows = read_jsonl(out / "rollouts.jsonl")
    samples = {(r["iteration"], r["prompt_index"]): (r["response_ids"], r["rewards"], r["version"]) for r in rows}
    weights = load_file(str(out / "checkpoint" / "model.safetensors"))
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if "tokens/trained" in m]
    return samples, weights, metrics


def weight_gap(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def differing(a: dict, b: dict) -> int:
    """Groups (iteration, prompt) whose tokens, rewards or version differ, or that one run lacks."""
    return sum(a.get(k) != b.get(k) for k in set(a) | set(b))


def train_runs(cfgs, engine_of: Callable) -> None:
    for cfg in cfgs:
        with engine_of(cfg) as engine:
            pipeline.run(cfg, engine=engine)


def check_runs(table: Table, name: str, a: Path, b: Path, weight_tol: float, model: str, dtype: str) -> None:
    sa, wa, _ = read_run(a)
    sb, wb, _ = read_run(b)
    n_diff, gap = differing(sa, sb), weight_gap(wa, wb)
    rewards = {r for _, rs, _ in sa.values() for r in rs}
    ok = n_diff == 0 and gap <= weight_tol and len(sa) > 0 and len(rewards) > 1
    table.add(check=name, model=model, dtype=dtype, value=n_diff, tolerance=0, passed=ok,
              status="ok" if ok else "FAILED: samples or weights differ (or rewards did not vary)",
              detail=f"{len(sa)} groups; groups differing {n_diff}; max weight gap {gap:.3g} (<= {weight_tol:g}); "
                     f"{len(rewards)} distinct rewards")


def check_logprobs(table: Table, sizes: Sizes, tokenizer, device: torch.device, backends: list[str],
                   budget: Budget) -> None:
    """Shared-prompt packing against per-response packing, per back-end: fp32 and bf16 autocast."""
    arch = sizes.archs[0]
    model = arch_model(arch, tokenizer, device, torch.float32, sizes.toy)
    segments = [random_group(model.config.vocab_size, P, lengths, seed=i)
                for i, (P, lengths) in enumerate(sizes.logprob_layout)]
    shared, per = pack(segments, shared=True).to(device), pack(segments, shared=False).to(device)
    bf16 = torch.autocast(device.type, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = token_logprobs(model, per, backend="dense")
        with bf16:
            noise = float((token_logprobs(model, per, backend="dense") - ref).abs().max())
        tol16 = max(2 * noise, 1e-3)
        for backend in backends:
            for dtype, tol in (("float32", 1e-4), ("bfloat16", tol16)):
                if budget.left() < 10:
                    table.add(check="shared_vs_per_response", model=arch, dtype=dtype, backend=backend,
                              status="skipped: time budget")
                    continue
                sp._flex_failed = False
                try:
                    with bf16 if dtype == "bfloat16" else torch.autocast(device.type, enabled=False):
                        a = token_logprobs(model, shared, backend=backend)
                        b = token_logprobs(model, per, backend=backend)
                    gap, err = float((a - b).abs().max()), float((a.double() - ref.double()).abs().max())
                    fell_back = backend == "flex" and sp._flex_failed
                    ok = gap <= tol and not fell_back
                    status = "ok" if ok else ("FAILED: FlexAttention fell back to split (see the log)" if fell_back
                                              else "FAILED: gap above tolerance")
                    table.add(check="shared_vs_per_response", model=arch, dtype=dtype, backend=backend,
                              value=f"{gap:.3g}", tolerance=f"{tol:.3g}", passed=ok, status=status,
                              detail=f"{len(a)} labels; max |shared - fp32 per-response dense| {err:.3g}; "
                                     f"bf16 noise (per-response dense bf16 vs fp32) {noise:.3g}")
                except Exception as e:  # noqa: BLE001 - one back-end failing must not hide the others
                    table.add(check="shared_vs_per_response", model=arch, dtype=dtype, backend=backend,
                              passed=False, status=failure(e))
    del model


def check_push_gap(table: Table, sizes: Sizes, tokenizer, device: torch.device, budget: Budget) -> None:
    """engine/verify.py's after-push probe, bf16 engine against the trainer, as the pipeline runs
    it: at random-init logits, and with the final norm x16 (the logit spread of a trained LM).

    Measured, not asserted by the probe itself (the gap is recorded even above `engine.verify_atol`):
    the gap against each way the trainer can score the probe (`reference`: its fp32 weights; its
    fp32 weights under bf16 autocast; the pushed bf16 weights, the engine's own precision), and
    the signal a missed push leaves (`missed_push_signal`: the probe's change when every weight
    moves by lr, an Adam step's size, scored in fp32 and on the bf16-rounded weights)."""
    atol = default_atol("bfloat16")
    bf16 = torch.autocast(device.type, dtype=torch.bfloat16)
    for arch in sizes.archs:
        if budget.left() < 15:
            table.add(check="push_probe_gap_bf16", model=arch, status="skipped: time budget")
            continue
        try:
            policy = arch_model(arch, tokenizer, device, torch.float32, sizes.toy)
            engine_model = arch_model(arch, tokenizer, device, torch.bfloat16, sizes.toy, seed=1)
            copy = arch_model(arch, tokenizer, device, torch.bfloat16, sizes.toy, seed=2)
            probe = probe_tokens(policy.config.vocab_size)
            norm = policy.model.norm.weight.detach().clone()
            for scale in (1.0, 16.0):
                with torch.no_grad():
                    policy.model.norm.weight.copy_(norm * scale)
                    spread = float(policy(input_ids=torch.tensor([probe], device=device)).logits.float().std())
                state = {k: v.detach().to(torch.bfloat16) for k, v in policy.state_dict().items()}
                with LocalEngine(engine_model, tokenizer, max_num_seqs=4) as engine:
                    push_s = engine.update_weights(state, 1)  # what Consumer.engine_state_dict pushes
                    (engine_lp,) = engine.probe_logprobs(probe).values()
                copy.load_state_dict(state)
                with bf16:
                    autocast_lp = model_logprobs(policy, probe)
                refs = {"float32": model_logprobs(policy, probe), "float32 under bf16 autocast": autocast_lp,
                        "pushed bf16 weights": model_logprobs(copy, probe)}
                for ref_name, ref in refs.items():
                    gap = float(abs(engine_lp - ref).max())
                    table.add(check="push_probe_gap_bf16", model=arch, dtype="bfloat16 engine", reference=ref_name,
                              value=f"{gap:.3g}", tolerance=atol, passed=gap <= atol, status="ok (measured)",
                              detail=f"final norm x{scale:g}: logit std {spread:.3g}; {len(probe) - 1} probe "
                                     f"log-probs; push {push_s:.3f}s")
                # what a push that did not arrive leaves: every weight moved by lr (an Adam step's size)
                before32 = refs["float32"]
                saved = {k: v.detach().clone() for k, v in policy.state_dict().items()}
                for lr in (1e-6, 1e-5):
                    g = torch.Generator(device=device).manual_seed(0)
                    with torch.no_grad():
                        for p in policy.parameters():
                            p.add_(lr * torch.sign(torch.randn(p.shape, generator=g, device=device)))
                    moved = {k: v.detach().to(torch.bfloat16) for k, v in policy.state_dict().items()}
                    changed = (sum(int((moved[k] != state[k]).sum()) for k in state)
                               / sum(v.numel() for v in state.values()))
                    signal32 = float(abs(model_logprobs(policy, probe) - before32).max())
                    copy.load_state_dict(moved)
                    signal16 = float(abs(model_logprobs(copy, probe) - refs["pushed bf16 weights"]).max())
                    copy.load_state_dict(state)
                    table.add(check="missed_push_signal", model=arch, dtype="float32 / bf16 weights",
                              reference=f"lr {lr:g}", value=f"{signal32:.3g}", status="ok (measured)",
                              detail=f"final norm x{scale:g}: probe change in fp32 {signal32:.3g}, "
                                     f"on bf16-rounded weights {signal16:.3g}; bf16 weights changed {changed:.3%}")
                    with torch.no_grad():
                        for k, v in policy.state_dict().items():
                            v.copy_(saved[k])
            del policy, engine_model, copy
        except Exception as e:  # noqa: BLE001
            table.add(check="push_probe_gap_bf16", model=arch, passed=False, status=failure(e))
        if device.type == "cuda":
            torch.cuda.empty_cache()


def step(args, sizes: Sizes, device: torch.device, budget: Budget, table: Table) -> None:
    tokenizer = tokenizer_at(args.work)
    tok_dir = args.work / "tokenizer"
    s = sizes
    common = dict(iterations=s.run_iterations, prompts=s.run_prompts, group=s.run_group, max_tokens=s.run_max_tokens,
                  **{"algorithm.attention_backend": "split"})
    runs = args.work / "runs"
    dev = str(device)

    def fresh(cfg):
        return make_engine(cfg.engine, cfg.model, backend="local")

    # 1. the device changes nothing but speed: the CPU run's tokens
    try:
        on_cpu = run_config(runs / "cpu", tok_dir, s.run_preset, "cpu", "float64", "sync-separated", **common)
        on_dev = run_config(runs / "dev", tok_dir, s.run_preset, dev, "float64", "sync-separated", **common)
        train_runs([on_cpu, on_dev], fresh)
        # tokens identical; weights within 1e-5 (lr 3e-3): CUDA sums in another order, and AdamW's
        # m / sqrt(v) turns round-off of a gradient that cancels to ~0 into a step of any size up to lr
        check_runs(table, f"{device.type}_run_equals_cpu_run", runs / "cpu", runs / "dev", 1e-5, s.run_preset,
                   "float64")
    except Exception as e:  # noqa: BLE001
        table.add(check=f"{device.type}_run_equals_cpu_run", passed=False, status=failure(e))
    # 2. the paper's claim on the device: periodic-async follows sync-separated
    try:
        sync_cfg = run_config(runs / "sync", tok_dir, s.run_preset, dev, "float64", "sync-separated", **common)
        async_cfg = run_config(runs / "async", tok_dir, s.run_preset, dev, "float64", "periodic-async", **common)
        with fresh(sync_cfg) as engine:  # one engine, as the pipeline tests share theirs
            train_runs([sync_cfg, async_cfg], lambda cfg: _Borrowed(engine))
        check_runs(table, "periodic_async_equals_sync_separated", runs / "sync", runs / "async", 1e-10,
                   s.run_preset, "float64")
    except Exception as e:  # noqa: BLE001
        table.add(check="periodic_async_equals_sync_separated", passed=False, status=failure(e))
    # 3. the after-push probe gap in bf16
    check_push_gap(table, s, tokenizer, device, budget)
    # 4. shared-prompt log-probs per back-end
    check_logprobs(table, s, tokenizer, device, backends_for(device, table, "shared_vs_per_response"), budget)
    # 5. a periodic-async run in bf16: mixed-precision trainer, the default back-end, probe gaps
    if budget.left() < 40:
        table.add(check="periodic_async_bf16_run", status="skipped: time budget")
        return
    try:
        sp._flex_failed = False
        cfg = run_config(runs / "bf16", tok_dir, s.bf16_preset, dev, "bfloat16", "periodic-async",
                         iterations=3, prompts=s.bf16_prompts, group=s.bf16_group, max_tokens=s.bf16_max_tokens,
                         **{"engine.stop": "[]", "algorithm.micro_batch_tokens": 4096})
        train_runs([cfg], fresh)
        _, _, metrics = read_run(runs / "bf16")
        gaps = [m["probe/max_gap"] for m in metrics if "probe/max_gap" in m]
        atol = cfg.engine.verify_atol if cfg.engine.verify_atol is not None else 0.1
        backend = resolve_backend("auto", device) + (" (fell back to split)" if sp._flex_failed else "")
        ok = len(metrics) == 3 and bool(gaps) and max(gaps) <= atol
        table.add(check="periodic_async_bf16_run", model=s.bf16_preset, dtype="bfloat16",
                  value=f"{max(gaps):.3g}" if gaps else "", tolerance=atol, passed=ok,
                  status="ok" if ok else "FAILED: run incomplete or probe gap above engine.verify_atol",
                  detail=f"{len(metrics)} iterations; probe gaps {[float(f'{g:.3g}') for g in gaps]}; attention "
                         f"{backend}; tokens/s per iteration "
                         f"{[round(m['throughput/tokens_per_s']) for m in metrics]}")
    except Exception as e:  # noqa: BLE001
        table.add(check="periodic_async_bf16_run", passed=False, status=failure(e))


class _Borrowed:
    """An engine lent to `train_runs` without closing it after the run."""

    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        return self.engine

    def __exit__(self, *exc):
        return None

