"""Shared fixtures: an offline environment and one tokenizer built per test session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


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
def experiment_script():
    """Load experiments/<name>.py as a module (the experiment scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"_experiment_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray session for one test module (shut down at its end)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()
