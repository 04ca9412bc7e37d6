"""Where engine workers' GPUs come from (engine/ray_cluster.py), checked on a CPU: an engine worker
never gets a GPU a trainer rank of this machine uses unless they are meant to share
(`engine.share_trainer_gpus`, by default only in pipeline.mode=sync-colocated). The assignment
logic on CUDA_VISIBLE_DEVICES / torchrun's variables, the start-up refusal, and a real local Ray
start that is shown only the engines' GPUs (Ray assigns the ids it is given; no GPU is needed)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from periodic_async.config import ConfigError, EngineConfig, ModelConfig, RunConfig, load_config, sharing_resolved
from periodic_async.engine.ray_cluster import check_engine_gpus, engine_gpus, trainer_gpus

ROOT = Path(__file__).resolve().parents[1]


def _cfgs(mode: str = "periodic-async", device: str = "cuda", **engine):
    cfg = load_config(RunConfig, None, [f"pipeline.mode={mode}", f"model.device={device}", "engine.backend=ray",
                                        *[f"engine.{k}={v}" for k, v in engine.items()]])
    return sharing_resolved(cfg), cfg.model


def test_engines_get_the_gpus_no_trainer_rank_uses():
    """One process on cuda:1 of GPUs 4,5,6: the engines get 4 and 6; under torchrun with 2 local ranks of
    4 GPUs, the last two; a CPU trainer leaves them all; sharing (sync-colocated, or the setting) gives all."""
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6"}
    assert trainer_gpus("cuda:1", env, 3) == [1] and trainer_gpus("auto", env, 3) == [0]
    assert engine_gpus(*_cfgs(device="cuda:1"), env) == ["4", "6"]
    assert engine_gpus(*_cfgs(device="cpu"), env) == ["4", "5", "6"]
    ranks = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert engine_gpus(*_cfgs(device="cuda"), ranks) == ["2", "3"]
    assert engine_gpus(*_cfgs(mode="sync-colocated"), ranks) == ["0", "1", "2", "3"]
    assert engine_gpus(*_cfgs(share_trainer_gpus=True), ranks) == ["0", "1", "2", "3"]
    assert _cfgs(mode="sync-separated")[0].share_trainer_gpus is False
    assert load_config(RunConfig, None, []).engine.share_trainer_gpus is None  # unset in the config itself


def test_workers_needing_a_trainers_gpu_are_refused_at_start_up():
    """A one-GPU machine with the trainer on it: GPU workers are a ConfigError naming the GPUs and what
    to change; workers on CPU (gpus_per_worker=0), sharing, or a free GPU pass."""
    one = {"CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(ConfigError, match=r"GPUs 0 run the trainer \(model.device=cuda\).*same accelerator"):
        check_engine_gpus(*_cfgs(), 1.0, one)
    ranks = {"CUDA_VISIBLE_DEVICES": "0,1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ConfigError, match="2 torchrun ranks"):
        check_engine_gpus(*_cfgs(), 0.5, ranks)
    check_engine_gpus(*_cfgs(), 0.0, one)
    check_engine_gpus(*_cfgs(share_trainer_gpus=True), 1.0, one)
    check_engine_gpus(*_cfgs(mode="sync-colocated"), 1.0, one)
    check_engine_gpus(*_cfgs(), 1.0, {"CUDA_VISIBLE_DEVICES": "0,1"})
    check_engine_gpus(EngineConfig(), ModelConfig(device="cuda"), 1.0, {})  # no GPU here: nothing to share


@pytest.mark.slow
def test_local_ray_start_is_shown_only_the_engines_gpus(tmp_path):
    """init_ray with 2 torchrun ranks on GPUs 5,6 of 5,6,7 (no GPU needed: Ray trusts the ids it is given):
    Ray has one GPU, a 1-GPU task gets id 7, and this process's CUDA_VISIBLE_DEVICES is left as it was
    (slow: a Ray start of its own, 30-90 s on a busy 2-core machine)."""
    code = textwrap.dedent("""
        import os, ray
        from periodic_async.config import EngineConfig, ModelConfig
        from periodic_async.engine.ray_cluster import init_ray
        assert init_ray(EngineConfig(backend="ray", share_trainer_gpus=False), ModelConfig(device="cuda"))
        task = ray.remote(num_gpus=1, num_cpus=0)(lambda: [str(g) for g in ray.get_gpu_ids()])
        print(ray.cluster_resources().get("GPU"), ray.get(task.remote()), os.environ["CUDA_VISIBLE_DEVICES"])
        ray.shutdown()
    """)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(CUDA_VISIBLE_DEVICES="5,6,7", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "1.0 ['7'] 5,6,7", r.stdout
