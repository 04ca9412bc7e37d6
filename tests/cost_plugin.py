"""The test-cost recorder of scripts/test_costs.py, a pytest plugin loaded only there
(`-p cost_plugin`, tests/ on PYTHONPATH): with PA_TEST_COSTS=<file.jsonl> set, it writes one JSON
line per phase (setup, call, teardown) of each test: its seconds, its outcome, and what it started
since the line before (a Ray instance, Ray engine workers and their backend, subprocesses by
program). Under pytest-xdist each worker writes <file.jsonl>.<worker>; the controller writes
nothing. Without PA_TEST_COSTS it records nothing and wraps nothing."""

import os


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
