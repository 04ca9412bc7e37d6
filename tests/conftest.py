"""Shared fixtures and helpers: an offline environment, one tokenizer built per test session, one
Ray instance per test process (shared by the modules that use Ray), and the tiny training run
the pipeline, checkpoint, fault and multi-node tests share (with what they read back: rollouts
by prompt, checkpoint weights).
Test modules import the helpers: `from conftest import tiny_run_config, ...`."""

import os

# Hermetic whatever the shell says (tests/test_config.py checks it): never the hub or W&B online, never
# a Ray cluster the shell points at (RAY_ADDRESS is engine.ray_address's default; tests that join one
# pass it explicitly).
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
os.environ.pop("RAY_ADDRESS", None)
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray starts workers at nice 15 unless this is set before its nodes start (init_ray sets it too): beside a
# busy process such workers starve (engine workers took minutes to start beside one CPU-bound process)
os.environ.setdefault("RAY_worker_niceness", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

HERE = Path(__file__).resolve()
DIVERSITY_REWARD = f"{HERE}:diversity_reward"
"""reward.functions of the tiny run: loaded by path (in the reward worker too)."""


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from periodic_async.data.tokenizer import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from periodic_async.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tests share a 2-core machine with Ray workers: one thread is faster and deterministic."""
    import torch

    torch.set_num_threads(1)


def stop_shared_ray() -> None:
    """Shut down this process's Ray instance (ray_session's), for a test that needs none running."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def _ray_until_the_end():
    """Shuts down the shared Ray instance (ray_session) when the test process ends."""
    yield
    stop_shared_ray()


@pytest.fixture(scope="module")
def ray_session(_ray_until_the_end):
    """The test process's one local Ray instance, shared by the modules that ask for it (start-up
    and shutdown cost about 8 s each): started by the engines' own `init_ray` (a new local
    instance on the loopback interface, never another cluster), kept until the process ends.
    An engine built while it runs joins it and leaves it running when closed. A module that needs
    Ray down (one joining a cluster of its own) calls `stop_shared_ray()`; the next module that
    asks starts it again."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        from periodic_async.config import EngineConfig
        from periodic_async.engine.ray_engine import init_ray

        init_ray(EngineConfig(backend="ray", num_workers=4))  # 4 CPUs: the placement tests' bundles fit
    return ray


# --- the tiny run: qwen2-1m in float64, 6 prompts x 3 samples of <= 12 tokens per iteration ---------

def diversity_reward(prompts, completions, **kwargs):
    """A dense reward an untrained model can vary on: distinct characters of the completion."""
    return [len(set(c)) / 10.0 for c in completions]


def tiny_run_config(out, tokenizer_dir, **overrides):
    """The run the pipeline-level tests share: qwen2-1m in float64 (exact comparisons), 3
    iterations of B=6 prompts x G=3 samples on 2 Ray engine workers, the diversity reward in
    process, periodic-async, output in `out`; `overrides` ("section.key": value) on top."""
    from periodic_async.config import RunConfig, load_config

    settings = {
        "model.tokenizer": str(tokenizer_dir), "model.dtype": "float64", "model.seed": 3,
        "data.num_train": 64, "data.num_eval": 0, "data.seed": 5,
        "reward.functions": DIVERSITY_REWARD, "reward.timeout_s": 0,  # in-process: no worker start-up
        "engine.backend": "ray", "engine.num_workers": 2,
        "engine.max_num_seqs": 6, "engine.max_tokens": 12, "engine.stop": "e",
        "algorithm.group_size": 3, "algorithm.prompts_per_iteration": 6, "algorithm.lr": 3e-3,
        "algorithm.micro_batch_tokens": 120, "algorithm.beta": 0.05,
        "trainer.iterations": 3, "trainer.output_dir": str(out), "trainer.eval_at_end": False,
        # one trainer thread throughout, as _one_torch_thread: on a loaded 2-core machine two
        # OpenMP threads train 10x slower than one (the default 'auto' is tested in test_consumer.py)
        "trainer.threads_after_generation": 0,
        "pipeline.mode": "periodic-async", "logging.wandb_mode": "disabled", "logging.progress": False,
    }
    settings.update(overrides)
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in settings.items()])


def read_rollouts(run_dir) -> list[dict]:
    from periodic_async.trace import read_jsonl

    return read_jsonl(Path(run_dir) / "rollouts.jsonl")


def by_prompt(rows: list[dict]) -> dict:
    """rollouts.jsonl rows keyed by (iteration, prompt): (tokens, rewards, version), whatever the
    order the trainer took them in."""
    return {(r["iteration"], r["prompt_index"]): (r["response_ids"], r["rewards"], r["version"]) for r in rows}


def checkpoint_weights(ckpt_dir) -> dict:
    """The weights of a checkpoint directory (e.g. <run>/checkpoint, the newest), as saved
    (safetensors, no pickle; a tied weight once)."""
    from safetensors.torch import load_file

    return load_file(Path(ckpt_dir) / "model.safetensors")


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |a[k] - b[k]| over the tensors of `a`; `b` must hold them all (a model's state dict
    also holds the tied weight a checkpoint saves once)."""
    assert a and a.keys() <= b.keys(), sorted(a.keys() - b.keys())
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --- engines: fixed requests, what they sample, what the Ray workers hold ----------------------

def engine_requests(n: int) -> list:
    """n requests of 4 prompt tokens, 2 samples of <= 12 tokens each, fixed per-request seeds."""
    from periodic_async.engine import Request, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=1.0)
    return [Request(f"r{i}", [5 + i, 9, 17, 33 + i], 2, params, seed=100 + i) for i in range(n)]


def engine_samples(engine, n: int, logprobs: bool = False) -> dict:
    """request id -> its samples' tokens (with their log-probs if `logprobs`) for `engine_requests(n)`."""
    return {o.request_id: [(s.token_ids, s.logprobs) if logprobs else s.token_ids for s in o.samples]
            for o in engine.generate(engine_requests(n))}


def worker_weights(engine) -> list[dict]:
    """The state dict of every Ray engine worker's model (copies)."""
    import ray

    def get(worker):
        return {k: v.clone() for k, v in worker.batcher.model.state_dict().items()}

    return ray.get([w.actor.__ray_call__.remote(get) for w in engine.workers])


# --- the order: the longest modules first (under pytest-xdist, whole modules go to whichever worker is free:
# longest first keeps one long module from running alone at the end) -------------------------------------------

LONGEST_FIRST = ["test_vllm", "test_engine", "test_pipeline", "test_sft", "test_multinode", "test_prepare",
                 "test_distributed", "test_bench", "test_notebooks", "test_checkpoint", "test_trl_api", "test_simulate",
                 "test_engine_faults", "test_cli", "test_affinity", "test_update_readme", "test_security"]
"""Modules by their measured time in the default suite (results/test_costs.csv), longest first."""


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's own order is kept


def pytest_collection_finish(session):
    """Take what collection imported (torch, transformers, vLLM, Ray: about 460,000 objects) out
    of the garbage collector's scans: every full collection, Python's own and the bench
    protocol's after each run, would walk them all again (0.4 s each on these machines) though
    they live until the process ends. Objects the tests create are collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """Back in the collector's reach for the interpreter's shutdown (extensions such as triton's
    report frozen instances as leaked)."""
    import gc

    gc.unfreeze()


# --- what each test starts, and its time (PA_TEST_COSTS=<file.jsonl>; scripts/test_costs.py reads it) ---

def _count_starts(counts: dict) -> None:
    """Wrap what a test may start, counting into `counts`: a Ray instance, Ray engine workers
    (and which backend they run), a vLLM engine in this process, subprocesses (by program)."""
    import subprocess

    from periodic_async.engine import ray_engine

    init_ray, start, popen = ray_engine.init_ray, ray_engine.RayEngine._start, subprocess.Popen.__init__

    def counted_init_ray(*a, **k):
        started = init_ray(*a, **k)
        counts["ray"] += int(started)
        return started

    def counted_start(self, indices, *a, **k):
        indices = list(indices)
        key = "vllm_workers" if self.cfg.worker_backend == "vllm" else "engine_workers"
        counts[key] += len(indices)
        return start(self, indices, *a, **k)

    def counted_popen(self, args, *a, **k):
        argv = [str(x) for x in (args if isinstance(args, (list, tuple)) else [args])]
        text = " ".join(argv)
        if "/ray/" in text or "ray/_private" in text:  # Ray's own processes: counted as the Ray start
            return popen(self, args, *a, **k)
        kind = ("torchrun" if "torchrun" in text or "torch.distributed.run" in text else
                "cli" if "periodic_async" in text and "-m" in argv else
                "script" if any(x.endswith((".py", ".sh")) for x in argv) else "other")
        counts[f"subprocess_{kind}"] += 1
        return popen(self, args, *a, **k)

    ray_engine.init_ray = counted_init_ray
    ray_engine.RayEngine._start = counted_start
    subprocess.Popen.__init__ = counted_popen


_COSTS = {"counts": None, "file": None}


def pytest_sessionstart(session):
    path = os.environ.get("PA_TEST_COSTS")
    if path and getattr(session.config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        return  # pytest-xdist's controller: the workers record their own tests
    if path:
        from collections import Counter

        worker = os.environ.get("PYTEST_XDIST_WORKER")  # under pytest-xdist: one file per worker process
        _COSTS["counts"], _COSTS["file"] = Counter(), open(f"{path}.{worker}" if worker else path, "w")
        _count_starts(_COSTS["counts"])


def pytest_runtest_logreport(report):
    """One line per phase of each test: nodeid, phase, seconds, and what was started since the last line."""
    if _COSTS["file"] is None:
        return
    import json

    counts = _COSTS["counts"]
    _COSTS["file"].write(json.dumps({"test": report.nodeid, "phase": report.when, "s": report.duration,
                                     "outcome": report.outcome, **counts}) + "\n")
    _COSTS["file"].flush()
    counts.clear()
