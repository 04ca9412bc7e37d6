"""Supervised warm start: a short run lifts held-out accuracy above the untrained model and
saves a model directory the RL runs can load."""

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
