"""What every step of the GPU check shares: the sizes (full and --toy), the Qwen2.5 architectures,
the cards' datasheet figures, each step's time budget, and the provenance and table every CSV row
goes through; timing and peak-memory helpers for CUDA (and their CPU stand-ins)."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from periodic_async.records import write_csv
from periodic_async.records import cpu_name, git_commit

PACKAGE = Path(__file__).resolve().parents[2]
"""periodic_async: the source `source_hash` names."""
ROOT = PACKAGE.parents[1]
"""The repository (src layout): pyproject.toml, scripts/."""

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


def random_group(vocab: int, P: int, lengths, seed: int, low: int = 4):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(low, vocab, (n,), generator=g).tolist()  # noqa: E731
    return ids(P), [ids(r) for r in lengths]



def backends_for(device: torch.device, table: Table, check: str | None = None) -> list[str]:
    """Attention back-ends that run on `device`: FlexAttention only on CUDA (reported skipped elsewhere)."""
    if device.type == "cuda":
        return ["flex", "split", "dense"]  # flex first: the default on CUDA, and the goal's row
    if check:
        table.add(check=check, backend="flex", status="skipped: FlexAttention runs on CUDA only here")
    else:
        table.add(backend="flex", status="skipped: FlexAttention runs on CUDA only here")
    return ["split", "dense"]


