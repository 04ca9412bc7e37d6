"""Shared fixtures and hooks: an offline environment (never the hub, W&B online or another Ray
cluster), one tokenizer built per test session, one torch thread, one Ray instance per test
process (shared by the modules that use Ray), the longest modules first (as last measured), collection's objects
frozen out of the garbage collector's scans.
What test modules share besides fixtures (the tiny run, engine requests, the vLLM tests' checks)
is in tests/helpers.py; the test-cost recorder of scripts/test_costs.py is tests/cost_plugin.py."""

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

import pytest  # noqa: E402
from helpers import stop_shared_ray  # noqa: E402


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


# --- the order: the longest modules first (under pytest-xdist, whole modules go to whichever worker is free:
# longest first keeps one long module from running alone at the end) -------------------------------------------

def _module_seconds() -> dict[str, float]:
    """Each module's seconds in the last measured default suite (results/test_costs.csv, written by
    scripts/test_costs.py); empty without it."""
    import csv
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "results" / "test_costs.csv"
    seconds: dict[str, float] = {}
    if path.is_file():
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                module = Path(row["test"].split("::")[0]).stem
                seconds[module] = seconds.get(module, 0.0) + float(row["seconds"])
    return seconds


def pytest_collection_modifyitems(session, config, items):
    """Longest modules first by their measured seconds; a module not yet measured after them all."""
    seconds = _module_seconds()
    items.sort(key=lambda item: -seconds.get(item.path.stem, 0.0))  # stable: a module's own order is kept


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
