"""The CUDA paths, checked against the CPU and against each other (run by scripts/gpu_check.sh;
skipped on machines without CUDA, such as CI's).

- the paper's claim on the GPU: periodic-async and sync-separated, trainer and Ray engine
  worker on CUDA, sample identical tokens and end at the same weights (fp64);
- the GPU changes nothing but speed: a sync-separated run with the trainer and the in-process
  engine on CUDA samples the tokens a CPU run samples (samples draw their uniforms from
  per-request numpy generators, so the device only changes logits at the 1e-15 level) and
  ends within fp64 round-off of the CPU weights;
- collective weight sync with nccl: on one GPU it is refused with an error naming the trainer
  and the worker sharing the device; with two or more it matches the object-store path.
(FlexAttention against the dense mask on CUDA: tests/test_shared_prompt.py.)
"""

import pytest
import torch

from helpers import by_prompt, checkpoint_weights, engine_samples, max_abs_diff, read_rollouts, tiny_run_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = {"model.device": "cuda", "engine.gpus_per_worker": 0.5,  # the two workers share the one GPU
        "engine.share_trainer_gpus": True}  # with the trainer


def _cfg(tmp, tokenizer_dir, mode: str, **extra):
    return tiny_run_config(tmp / mode, tokenizer_dir, **{"pipeline.mode": mode, **extra})


def _final_weights(cfg) -> dict:
    return checkpoint_weights(f"{cfg.trainer.output_dir}/checkpoint")


def test_async_matches_sync_on_cuda(tokenizer_dir, tmp_path):
    from periodic_async.engine import make_engine
    from periodic_async.pipeline import run

    sync, asyn = (_cfg(tmp_path, tokenizer_dir, m, **CUDA) for m in ("sync-separated", "periodic-async"))
    with make_engine(sync.engine, sync.model) as engine:
        devices = {w["device"] for w in engine.info()}
        assert devices == {"cuda:0"}, devices
        run(sync, engine=engine)
        run(asyn, engine=engine)
    rs, ra = read_rollouts(sync.trainer.output_dir), read_rollouts(asyn.trainer.output_dir)
    assert len(rs) == len(ra) == 3 * 6
    assert by_prompt(rs) == by_prompt(ra)
    assert any(r["rewards"] != rs[0]["rewards"] for r in rs), "rewards must vary, or the test proves nothing"
    gap = max_abs_diff(_final_weights(sync), _final_weights(asyn))
    print(f"periodic-async vs sync-separated on CUDA: max weight gap {gap:.3g} (fp64)")
    assert gap <= 1e-10


def test_cuda_run_matches_cpu_run(tokenizer_dir, tmp_path):
    from periodic_async.engine import make_engine
    from periodic_async.pipeline import run

    on_cpu = _cfg(tmp_path / "cpu", tokenizer_dir, "sync-separated", **{"model.device": "cpu"})
    on_gpu = _cfg(tmp_path / "gpu", tokenizer_dir, "sync-separated", **{"model.device": "cuda"})
    for cfg in (on_cpu, on_gpu):
        with make_engine(cfg.engine, cfg.model, backend="local") as engine:
            run(cfg, engine=engine)
    rc, rg = read_rollouts(on_cpu.trainer.output_dir), read_rollouts(on_gpu.trainer.output_dir)
    assert by_prompt(rc) == by_prompt(rg), "the GPU run sampled other tokens"
    gap = max_abs_diff(_final_weights(on_cpu), _final_weights(on_gpu))
    print(f"CUDA vs CPU (fp64, 3 iterations): max weight gap {gap:.3g}")
    assert gap <= 1e-8


def test_collective_sync_on_cuda(tokenizer_dir):
    from periodic_async.config import ConfigError, RunConfig, load_config
    from periodic_async.engine import make_engine

    n = torch.cuda.device_count()
    # The trainer on the last GPU; Ray hands the worker the lowest free one (GPU 0).
    overrides = {"model.name_or_path": "qwen2-micro", "model.tokenizer": str(tokenizer_dir),
                 "model.device": f"cuda:{n - 1}", "engine.backend": "ray", "engine.num_workers": 1,
                 "engine.max_num_seqs": 4, "engine.weight_sync": "collective", "engine.weight_sync_bucket_mb": 0.02}
    cfg = load_config(RunConfig, None, [f"{k}={v}" for k, v in overrides.items()])
    if n == 1:
        with pytest.raises(ConfigError, match="same accelerator"):
            make_engine(cfg.engine, cfg.model)
        return
    from helpers import worker_weights

    from periodic_async.model import load_policy

    policy, _ = load_policy(cfg.model)
    pushed = {k: v.detach().clone() + 0.01 for k, v in policy.state_dict().items()}
    store = load_config(RunConfig, None,
                        [f"{k}={v}" for k, v in {**overrides, "engine.weight_sync": "object_store"}.items()])
    with make_engine(store.engine, store.model) as by_store, make_engine(cfg.engine, cfg.model) as by_nccl:
        by_store.update_weights(pushed, 1)
        by_nccl.update_weights(pushed, 1)
        for weights in worker_weights(by_nccl):
            assert all(torch.equal(weights[k].cpu(), pushed[k].cpu()) for k in pushed)
        assert engine_samples(by_store, 4, logprobs=True) == engine_samples(by_nccl, 4, logprobs=True)
