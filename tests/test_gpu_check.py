"""The GPU check on a CPU: the code a GPU will run has run once (toy sizes), and what it needs.

- the driver, `bash scripts/gpu_check.sh OUT`, refuses a machine without CUDA: exit 2, one line;
- each step of periodic_async.bench.gpu runs at toy sizes on the CPU and writes its CSV
  with the provenance columns and the measurement columns the docs and the simulator read;
- the Qwen2.5 architectures in the repository have the published sizes (0.49B, 1.54B);
- scripts/gpu_wheels.sh lists exactly the project dependencies the check imports besides torch
  and transformers (a slow test runs the whole driver and reads what each step imported);
- the simulator takes the check's trainer.csv / engine.csv (written here by the toy run) into
  its costs (scale/calibrate.py) and plans on them.
"""

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from periodic_async.bench.gpu import common, models, preflight
from periodic_async.bench.gpu.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE = ["commit", "src_sha", "gpu", "device", "memory_gb", "torch", "cuda", "toy"]
TOY_ARGS = ["--device", "cpu", "--toy", "--peak-tflops", "1", "--hbm-gbps", "50"]


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["status"].startswith("skipped")]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, tokenizer_dir):
    """Runs a step at toy sizes on the CPU (in this process), once per step; returns its rows."""
    out = tmp_path_factory.mktemp("gpu_check")
    work = out / "work"
    shutil.copytree(tokenizer_dir, work / "tokenizer")  # the session's, instead of building another
    done = {}

    def run(step: str) -> tuple[Path, list[dict]]:
        if step not in done:
            rc = main([step, "--out", str(out), "--work", str(work), *TOY_ARGS])
            done[step] = rc
        assert done[step] == 0, f"step {step} failed: see its rows in {out}/{step}.csv"
        return out, _rows(out / f"{step}.csv")
    return run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_driver_without_cuda_exits_2_with_one_line(tmp_path):
    """`bash scripts/gpu_check.sh OUT` without a CUDA device exits 2 with one line and measures nothing."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    r = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "PYTHON": sys.executable}, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device visible"), r.stderr
    assert not list(out.glob("*.csv")), "nothing is measured without CUDA"


def test_correctness_step_on_cpu(toy_run):
    """The claims' checks run and pass at toy sizes; FlexAttention is reported skipped off CUDA."""
    _, rows = toy_run("correctness")
    assert set(PROVENANCE + ["check", "value", "tolerance", "passed", "status", "detail"]) <= set(rows[0])
    checks = {r["check"] for r in _measured(rows)}
    assert checks == {"cpu_run_equals_cpu_run", "periodic_async_equals_sync_separated", "push_probe_gap_bf16",
                      "missed_push_signal", "shared_vs_per_response", "periodic_async_bf16_run"}
    assert all(r["status"].startswith("ok") and r["passed"] in ("True", "") for r in _measured(rows)), rows
    assert {r["backend"] for r in rows if r["check"] == "shared_vs_per_response"} == {"split", "dense", "flex"}
    assert [r["status"] for r in rows if r["backend"] == "flex"] == ["skipped: FlexAttention runs on CUDA only here"]
    gaps = {(r["model"], r["detail"][:15], r["reference"]): float(r["value"]) for r in rows
            if r["check"] == "push_probe_gap_bf16"}
    assert len(gaps) == 2 * 2 * 3 and all(g <= 0.1 for g in gaps.values()), gaps
    for (model, scale, reference), g in gaps.items():  # the built-in engine runs the trainer's code on its weights
        assert (g == 0) == (reference == "pushed bf16 weights"), (model, scale, reference, g)
    signals = [r for r in rows if r["check"] == "missed_push_signal"]
    assert len(signals) == 2 * 2 * 2 and all(float(r["value"]) > 0 for r in signals), signals


def test_attention_step_on_cpu(toy_run):
    """Both packings per shape and back-end; packed tokens as the layout says; the token bound."""
    _, rows = toy_run("attention")
    sizes = common.TOY
    G = sizes.group
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 2 * 2 * len(sizes.attention_prompts) * len(sizes.attention_responses)  # split, dense
    for r in ok:
        P, R = int(r["P"]), int(r["R"])
        assert float(r["token_bound"]) == pytest.approx((G * P + G * R) / (P + G * R), abs=1e-3)
        expected = P + G * (R - 1) if r["packing"] == "shared" else G * (P + R - 1)
        assert int(r["packed_tokens"]) == expected and int(r["labels"]) == G * R
        assert float(r["time_s"]) > 0 and set(PROVENANCE) <= set(r)
        assert (r["speedup_vs_per_response"] != "") == (r["packing"] == "shared")


def test_trainer_step_on_cpu(toy_run):
    """The tri-model micro-step's tokens/s and MFU, policy only, with the reference, and with the
    reference under activation checkpointing and chunked logits, per architecture."""
    _, rows = toy_run("trainer")
    assert [(r["model"], r["models"]) for r in rows] == [(a, m) for a in common.TOY.archs
                                                         for m in ("policy", "policy+ref", "policy+ref, checkpointed")]
    assert [(r["gradient_checkpointing"], r["logits_chunk_tokens"]) for r in rows[:3]] == [
        ("False", "0"), ("False", "0"), ("True", "4096")]
    for r in rows:
        assert r["status"] == "ok"
        assert int(r["params"]) > int(r["body_params"]) > 0
        assert float(r["tokens_per_s"]) > 0 and float(r["mfu"]) > 0 and float(r["peak_tflops"]) == 1.0
        P, G, R = common.TOY.trainer_group
        assert int(r["packed_tokens"]) == P + G * (R - 1) and int(r["labels"]) == G * R


def test_engine_step_on_cpu(toy_run):
    """The built-in engine and HF generate at each slot count, every sample decoded to full length."""
    _, rows = toy_run("engine")
    sizes = common.TOY
    assert {(r["engine"], int(r["slots"])) for r in rows} == {(e, s) for e in ("batcher", "hf_generate")
                                                               for s in sizes.engine_slots}
    for r in rows:
        assert r["status"] == "ok" and float(r["tokens_per_s"]) > 0
        assert int(r["generated_tokens"]) == int(r["slots"]) * sizes.engine_max_tokens  # ignore_eos: full length
        assert (r["vs_hf_generate"] != "") == (r["engine"] == "batcher")


def test_architectures_have_the_published_sizes(tokenizer):
    """Qwen2.5-0.5B: 0.49B parameters, 1.54B for -1.5B (model cards), on the meta device."""
    from transformers import AutoModelForCausalLM

    from periodic_async.model import num_parameters

    for name, published in (("qwen2.5-0.5b", 0.49e9), ("qwen2.5-1.5b", 1.54e9)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(models.arch_config(name, tokenizer, toy=False))
        assert round(num_parameters(model) / 1e7) == round(published / 1e7), (name, num_parameters(model))
        assert set(model.config.layer_types) == {"full_attention"}  # what shared-prompt packing needs


def test_wheel_list_is_what_the_check_needs_beyond_torch_and_transformers():
    """scripts/gpu_wheels.sh --list pins exactly the project dependencies the check requires besides torch
    and transformers (pyyaml, numpy, tokenizers, tqdm), with the module each provides."""
    listed = subprocess.run(["bash", "scripts/gpu_wheels.sh", "--list"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    names = {preflight._norm(x.split("==")[0]) for x in listed}
    assert all("==" in x for x in listed), "pinned versions"
    needed = {preflight._norm(d) for d in preflight.REQUIRED.values()} & preflight.project_dependencies()
    assert names == needed - {"torch", "transformers"} == {"pyyaml", "numpy", "tokenizers", "tqdm"}
    pairs = subprocess.run(["bash", "scripts/gpu_wheels.sh", "--modules"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert {tuple(p.split()) for p in pairs} == {(d, m) for m, d in preflight.REQUIRED.items() if d in names}


def test_simulator_takes_the_checks_costs(toy_run, tmp_path):
    """calibrate.load_gpu_check reads the toy run's trainer.csv and engine.csv; the device file it
    writes carries the measured utilisation and the planner simulates on it."""
    from periodic_async.scale.calibrate import load_device_file, load_gpu_check, measured_device_file
    from periodic_async.scale.plan import DEFAULT_COSTS, plan

    out, train = toy_run("trainer")
    toy_run("engine")
    m = load_gpu_check(out)
    biggest = max((r for r in train if r["models"] == "policy+ref"), key=lambda r: int(r["params"]))
    assert m.train_token_s == pytest.approx(1 / float(biggest["tokens_per_s"]))
    assert m.peak_tflops == 1.0 and m.hbm_GBps == 50.0 and m.gpu == biggest["gpu"]
    for r in _rows(out / "engine.csv"):  # a + b * slots: the batcher's step times
        if r["engine"] == "batcher":
            step_s = float(r["wall_s"]) / int(r["decode_steps"])
            assert m.decode_step_s + m.decode_seq_s * int(r["slots"]) == pytest.approx(step_s, rel=0.5)
    name, path = measured_device_file(m, DEFAULT_COSTS, tmp_path / "measured.yaml")
    devices, assumptions = load_device_file(path)
    assert list(devices) == [name] and name == f"{m.gpu} (measured)"
    assert assumptions["mfu_train"] == pytest.approx(8 * m.train_params / (m.train_token_s * 1e12), rel=1e-3)
    assert "MEASURED" in path.read_text().splitlines()[0]
    work = dict(batch=8, group=4, prompt_tokens=16, response_median=16, response_sigma=0.5, max_tokens=32,
                max_num_seqs=16, micro_batch_tokens=256, shared_prompt=True)
    points, _ = plan([2, 4], 1e5, name, work, path)
    assert points and all(p.tokens_per_s > 0 for p in points)
    # one slot count cannot give a and b: b is the example's, a the rest of the measured step
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(out / "trainer.csv", one)
    rows = _rows(out / "engine.csv")
    keep = [r for r in rows if r["slots"] == rows[0]["slots"]]
    with (one / "engine.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(keep)
    m1 = load_gpu_check(one)
    (batcher,) = [r for r in keep if r["engine"] == "batcher"]
    step_s = float(batcher["wall_s"]) / int(batcher["decode_steps"])
    assert m1.decode_seq_s is None and m1.decode_slots == int(keep[0]["slots"]) and m1.decode_step_s == step_s
    _, path1 = measured_device_file(m1, DEFAULT_COSTS, tmp_path / "measured1.yaml")
    _, example = load_device_file(DEFAULT_COSTS)
    _, measured = load_device_file(path1)
    assert measured["mfu_decode"] == example["mfu_decode"] and "one slot count" in path1.read_text()
    seq_s = 2 * m1.engine_params / (example["mfu_decode"] * m1.peak_tflops * 1e12)
    weights_read = 2 * m1.engine_params / (m1.hbm_GBps * 1e9 * example["hbm_util"])
    assert measured["decode_overhead_s"] == pytest.approx(max(0.0, step_s - seq_s * m1.decode_slots - weights_read),
                                                          rel=1e-3, abs=1e-9)


@pytest.mark.slow
def test_driver_runs_every_step_at_toy_size_and_imports_only_the_wheels(tmp_path):
    """`GPU_CHECK_DEVICE=cpu GPU_CHECK_TOY=1 bash scripts/gpu_check.sh OUT`: four CSVs and one log
    (the GPU machine returns at most 8 files), and each step imported, of the project's
    dependencies, torch, transformers and the wheel list only: no Ray, vLLM, W&B, TRL, datasets."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_TOY": "1",
           "GPU_CHECK_ARGS": "--peak-tflops 1 --hbm-gbps 50"}
    r = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["attention.csv", "correctness.csv", "engine.csv",
                                                     "gpu_check.log", "trainer.csv"]
    log = (out / "gpu_check.log").read_text()
    lines = [x for x in log.splitlines() if x.startswith("gpu_check imports:")]
    assert len(lines) == 5  # preflight and the four steps
    wheels = {preflight._norm(x.split("==")[0]) for x in subprocess.run(
        ["bash", "scripts/gpu_wheels.sh", "--list"], cwd=ROOT, capture_output=True, text=True).stdout.split()}
    loaded = set()
    for line in lines:
        deps, optional = line.split("loaded: ", 1)[1].split("; optional loaded: ")
        assert optional == "none", line
        loaded |= set(deps.split())
    assert loaded == wheels | {"torch", "transformers"}


@pytest.mark.slow
def test_scaling_predicts_on_measured_costs(toy_run, tmp_path):
    """experiments/scaling.py --predictions-only beside a GPU check's CSVs: the example's rows and
    the measured device's, each labelled by where its costs came from."""
    out, _ = toy_run("trainer")
    toy_run("engine")
    res = tmp_path / "results"
    subprocess.run([sys.executable, "experiments/scaling.py", "--predictions-only", "--quick", "--device-types",
                    "H100-SXM-80GB", "--gpu-results", str(out), "--results", str(res)], cwd=ROOT, check=True,
                   timeout=600)
    rows = _rows(res / "scaling_simulated.csv")
    costs = {r["device_type"]: r["costs"] for r in rows}
    assert costs["H100-SXM-80GB"] == "example (illustrative assumptions)"
    measured = [c for d, c in costs.items() if d.endswith("(measured)")]
    assert len(measured) == 1 and measured[0].startswith("one ") and ", measured (" in measured[0]
    assert (res / "device_costs.measured.yaml").is_file()
