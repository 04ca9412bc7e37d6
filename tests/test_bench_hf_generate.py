"""The static-batching baseline of experiments/engine_throughput.py (bench/hf_generate.py) on a
tiny preset, on CPU, for a couple of tokens: batches of max_num_seqs // G prompts, every sample
exactly its batch's max_tokens long (eos ignored), and the worker processes' tokens/s."""

import math

import pytest

from periodic_async.bench.hf_generate import HFWorkers, generate, sampling_config, static_batches
from periodic_async.config import ModelConfig
from periodic_async.engine import Request, SamplingParams


def _requests(max_tokens: list[int], group: int = 2) -> list[Request]:
    return [Request(f"r{i}", [5 + i, 9, 17, 33 + i][: 2 + i % 3], group, SamplingParams(max_tokens=m, ignore_eos=True),
                    seed=i) for i, m in enumerate(max_tokens)]


@pytest.fixture(scope="module")
def model_cfg(tokenizer_dir):
    return ModelConfig(name_or_path="qwen2-1m", tokenizer=str(tokenizer_dir), device="cpu")


def test_static_batches_hold_max_num_seqs_sequences():
    requests = _requests([2, 3, 2, 1, 2], group=2)
    assert [[r.request_id for r in b] for b in static_batches(requests, max_num_seqs=4)] == [
        ["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert [len(b) for b in static_batches(requests, max_num_seqs=1)] == [1] * 5  # fewer slots than G: one prompt


def test_generate_runs_each_batch_to_its_longest_request(model_cfg):
    from periodic_async.model import load_policy

    model, tok = load_policy(model_cfg)
    gen_cfg = sampling_config(model)
    assert gen_cfg.eos_token_id is None and gen_cfg.do_sample and gen_cfg.temperature == 1.0
    requests = _requests([2, 3, 1], group=2)
    out = generate(model, tok, gen_cfg, static_batches(requests, max_num_seqs=4))
    assert [tuple(t.shape) for t in out] == [(4, 3), (2, 1)]  # G x prompts rows, the batch's longest request
    assert all(int(t.min()) >= 0 and int(t.max()) < model.config.vocab_size for t in out)
    capped = generate(model, tok, gen_cfg, static_batches(requests, max_num_seqs=4)[:1], cap=2)
    assert tuple(capped[0].shape) == (4, 2)


def test_workers_report_generated_tokens_per_second(model_cfg):
    hf = HFWorkers(model_cfg, workers=1, max_num_seqs=4)
    try:
        alive = [p.is_alive() for p in hf.procs]
        tokens_per_s = hf.throughput(_requests([2, 2], group=2))
    finally:
        hf.close()
    assert alive == [True]
    assert tokens_per_s > 0 and math.isfinite(tokens_per_s)
    assert not any(p.is_alive() for p in hf.procs)
