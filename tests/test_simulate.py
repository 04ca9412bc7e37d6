"""The simulator (simulate.py) against hand computations, its calibration (calibrate.py) against
known costs and against real runs of this repository, and the planner (plan.py)."""

import math
import os
import statistics
from pathlib import Path

import numpy as np
import pytest

from periodic_async.scale.calibrate import (MeasuredIteration, MeasuredRun, device_costs, fit_costs, load_device_file,
                                      load_run, nnls, simulate_measured)
from periodic_async.scale.simulate import (Costs, Deployment, MicroBatches, Workload, engine_chunks,
                                     simulate_iteration)

from helpers import DIVERSITY_REWARD

ROOT = Path(__file__).resolve().parents[1]


def _costs(**kw) -> Costs:
    base = dict(decode_step_s=1.0, decode_seq_s=0.0, prefill_token_s=0.0, train_token_s=1.0)
    return Costs(**{**base, **kw})


def test_engine_chunks_by_hand():
    """slots=2; samples (group, P, R): (0,10,5) (1,10,3) (2,10,4) hold a slot for R-1 = 4, 2, 3 steps."""
    chunks = list(engine_chunks([(0, 10, 5), (1, 10, 3), (2, 10, 4)], slots=2))
    # steps 0-1: groups 0, 1 (contexts 10+10, then 11+11); group 1 done after step 1
    # steps 2-3: groups 0, 2 (12+10, 13+11); group 0 done; step 4: group 2 alone (12)
    assert [(c.prefill_tokens, c.steps, c.n, c.ctx_sum, c.finished) for c in chunks] == [
        (20, 2, 2, 42.0, (1,)), (10, 2, 2, 46.0, (0,)), (0, 1, 1, 12.0, (2,))]
    c = Costs(decode_step_s=1.0, decode_seq_s=0.1, decode_ctx_s=0.01, prefill_token_s=0.001, train_token_s=0)
    assert sum(ch.seconds(c) for ch in chunks) == pytest.approx(5 * 1.0 + 0.1 * (4 + 4 + 1) + 0.01 * 100 + 0.001 * 30)


def _constant(B, G, R):
    return [[R] * G for _ in range(B)], [0] * B


def test_all_samples_in_the_slots_no_overlap():
    """B*G <= slots: every group finishes at once (first = gen), so periodic-async = gen + train + sync
    = max(gen, first + train) + sync, exactly sync-separated."""
    L, P = _constant(4, 2, 11)  # 10 decode steps each
    w = Workload(prompts=4, group_size=2, slots=8, micro_batch_tokens=0, model_bytes=100.0)
    c = _costs(train_token_s=0.5, sync_base_s=2.0, sync_per_byte_s=0.01)
    gen, train, sync = 10.0, 0.5 * 4 * 22, 3.0
    for mode in ("sync-separated", "periodic-async"):
        r = simulate_iteration(L, P, w, Deployment(mode, 1, 1), c)
        assert (r.generate_s, r.first_group_s, r.train_busy_s, r.sync_s) == (gen, gen, train, sync)
        assert r.iteration_s == pytest.approx(max(gen, r.first_group_s + train) + sync)
        assert r.iteration_s == pytest.approx(gen + train + sync)


def test_waves_by_hand():
    """slots=2, G=1, B=4, 10 decode steps of 1 s: groups done at 10, 10, 20, 20. Training a group
    costs tau; the trainer starts at the first group in periodic-async, after all in sync."""
    L, P = _constant(4, 1, 11)
    w = Workload(prompts=4, group_size=1, slots=2, micro_batch_tokens=0)
    for tau, expect_async in ((1.1, 20 + 2 * 1.1),   # trainer keeps up: the tail is the last wave's training
                              (11.0, 10 + 4 * 11.0)):  # trainer-bound: first group + all the training
        c = _costs(train_token_s=tau / 11, sync_base_s=0.5)
        a = simulate_iteration(L, P, w, Deployment("periodic-async", 1, 1), c)
        s = simulate_iteration(L, P, w, Deployment("sync-separated", 1, 1), c)
        assert a.iteration_s == pytest.approx(expect_async + 0.5)
        assert a.iteration_s == pytest.approx(max(20, 10 + 4 * tau) + (2 * tau if tau < 5 else 0) + 0.5)
        assert s.iteration_s == pytest.approx(20 + 4 * tau + 0.5)
        assert a.first_group_s == 10 and a.generate_s == 20


def test_colocated_uses_every_device_for_both_phases():
    """4 devices, engines of 2: 2 engines generate B=4 groups (2 each, slots 1: 2 x 10 s), then
    4 trainer devices at dp_efficiency 0.9 per doubling (speedup 4 * 0.81 over 1), + switch."""
    L, P = _constant(4, 1, 11)
    w = Workload(prompts=4, group_size=1, slots=1, micro_batch_tokens=0)
    c = _costs(train_token_s=1.0, dp_efficiency=0.9, devices_per_engine=2, colocate_switch_s=3.0)
    r = simulate_iteration(L, P, w, Deployment("sync-colocated", 4, 4), c)
    assert r.generate_s == pytest.approx(20.0)
    assert r.train_busy_s == pytest.approx(44 / (4 * 0.81))
    assert r.iteration_s == pytest.approx(20 + 44 / (4 * 0.81) + 3.0)
    assert r.devices == 4


def test_processor_sharing_and_contention():
    """Two engines of 10 s of work each: 10 s alone each; on 1 core 20 s; with contention 0.5 on
    2 cores 15 s."""
    L, P = _constant(2, 1, 11)
    w = Workload(prompts=2, group_size=1, slots=1, micro_batch_tokens=0)
    dep = Deployment("sync-separated", 2, 1)
    gen = [simulate_iteration(L, P, w, dep, _costs(train_token_s=0, **kw)).generate_s
           for kw in ({}, {"host_cores": 1}, {"host_cores": 2, "contention": 0.5})]
    assert gen == pytest.approx([10.0, 20.0, 15.0])


def test_micro_batches_match_the_batcher():
    """The simulator's token-count port packs exactly as batching.MicroBatcher on real Groups."""
    from periodic_async.batching import MicroBatcher
    from periodic_async.group import Group

    rng = np.random.default_rng(0)
    for budget, shared in ((0, True), (64, True), (64, False), (200, True), (7, True)):
        real, port = MicroBatcher(budget, 2, shared), MicroBatches(budget, 2, shared)
        got, want = [], []
        for i in range(9):
            p, lengths = int(rng.integers(3, 30)), [int(x) for x in rng.integers(1, 40, size=4)]
            g = Group(i, 0, 0, [1] * p, [[2] * r for r in lengths], [[0.0] * r for r in lengths], [0.0] * 4, [0.0] * 4)
            want += [mb.num_packed_tokens(shared) for mb in real.add(g)]
            got += port.add(p, lengths)
        want += [mb.num_packed_tokens(shared) for mb in real.flush()]
        got += port.flush()
        assert got == want, (budget, shared)


def test_nnls_exact_and_non_negative():
    X = np.array([[1.0, 2.0], [2.0, 1.0], [3.0, 5.0], [1.0, 0.0]])
    assert nnls(X, X @ np.array([0.3, 0.7])) == pytest.approx([0.3, 0.7])
    assert nnls(X, X @ np.array([1.0, -0.5])).min() >= 0


def _synthetic_run(name, mode, engines, costs, rng, B=8, G=4, slots=4):
    """A 'measured' run whose times come from the simulator with known costs."""
    w = Workload(B, G, slots, 64, 1, True, 1000.0)
    dep = Deployment(mode, engines, 1)
    run = MeasuredRun(name, dep, w, 1)
    for _ in range(4):
        L = rng.integers(2, 30, size=(B, G)).tolist()
        r = simulate_iteration(L, [12] * B, w, dep, costs)
        m = {"time/generate_s": r.generate_s, "time/train_s": r.train_busy_s, "time/sync_s": r.sync_s,
             "time/iteration_s": r.iteration_s}
        run.iterations.append(MeasuredIteration(L, 12, m))
    return run


def test_calibration_recovers_known_costs():
    true = Costs(decode_step_s=0.01, decode_seq_s=0.0, prefill_token_s=0.0, train_token_s=2e-3, sync_base_s=0.05,
                 host_cores=2, contention=0.3)
    rng = np.random.default_rng(1)
    runs = [_synthetic_run("s1", "sync-separated", 1, true, rng), _synthetic_run("a1", "periodic-async", 1, true, rng),
            _synthetic_run("a2", "periodic-async", 2, true, rng)]
    fit = fit_costs(runs, host_cores=2)
    assert fit.decode_step_s == pytest.approx(0.01, rel=1e-6)
    assert fit.train_token_s == pytest.approx(2e-3, rel=1e-6)
    assert fit.sync_base_s == pytest.approx(0.05)
    assert fit.contention == pytest.approx(0.3, abs=1e-3)
    for r in runs:
        for s, it in zip(simulate_measured(r, fit), r.iterations):
            assert s.iteration_s == pytest.approx(it.metrics["time/iteration_s"], rel=1e-3)


def test_device_costs_by_hand():
    """32B on the example H100 figures: engines of 2 (64 GB of weights in half of 2 x 0.9 x 80 GB),
    D0 = ceil(18 B x 32e9 / (0.6 x 80 GB)) = 12, train 8N FLOP per token over D0 devices."""
    devices, assumptions = load_device_file(ROOT / "experiments" / "device_costs.example.yaml")
    spec = devices["H100-SXM-80GB"]
    dc = device_costs(spec, assumptions, 32e9, context_tokens=2000, max_num_seqs=256)
    c = dc.costs
    assert c.devices_per_engine == 2 and c.train_ref_devices == 12
    assert c.decode_step_s == pytest.approx(64e9 / (2 * 3350e9 * 0.6) + 0.004)
    assert c.train_token_s == pytest.approx(8 * 32e9 / (12 * 989e12 * 0.35))
    assert c.sync_s(64e9) == pytest.approx(1.0 + 64e9 / 50e9)
    kv_tokens = (0.9 * 2 * 80e9 - 64e9) / (8.2e-6 * 32e9)
    assert dc.slots == min(256, int(kv_tokens // 2000))


def test_plan_command(capsys):
    from periodic_async.__main__ import main

    main(["plan", "--model-params", "1e9", "--devices", "8,16", "--batch", "16", "--group", "4",
          "--response-median", "200", "--max-tokens", "1024"])
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "periodic-async" in out and "sync-colocated" in out


# --- against real runs of this repository ----------------------------------------------------

@pytest.fixture(scope="module")
def measure_runs(ray_session, tokenizer_dir, tmp_path_factory):
    """Measures two tiny real runs (sync-separated, periodic-async; 1 Ray engine worker, 1 trainer
    thread), 4 iterations each, the first left out: a few seconds each. A function, so that the
    test can measure again."""
    from periodic_async.config import RunConfig, load_config
    from periodic_async.engine import make_engine
    from periodic_async.pipeline import run

    def measure() -> dict[str, MeasuredRun]:
        tmp = tmp_path_factory.mktemp("sim")
        base = {"model.tokenizer": str(tokenizer_dir), "data.num_train": 256, "data.num_eval": 0,
                "reward.functions": DIVERSITY_REWARD, "engine.backend": "ray",
                "engine.num_workers": 1, "engine.max_num_seqs": 8, "engine.max_tokens": 24, "engine.stop": "e",
                "algorithm.group_size": 4, "algorithm.prompts_per_iteration": 12, "algorithm.micro_batch_tokens": 96,
                "trainer.iterations": 4, "trainer.eval_at_end": False, "logging.wandb_mode": "disabled",
                "logging.progress": False,
                "trainer.threads_after_generation": 0}  # the simulator models a trainer of fixed size
        cfgs = {m: load_config(RunConfig, None, [f"{k}={v}" for k, v in {**base, "pipeline.mode": m,
                                                                         "trainer.output_dir": str(tmp / m)}.items()])
                for m in ("sync-separated", "periodic-async")}
        engine = make_engine(cfgs["sync-separated"].engine, cfgs["sync-separated"].model)
        try:
            for cfg in cfgs.values():
                run(cfg, engine=engine)
        finally:
            engine.close()
        return {m: load_run(tmp / m) for m in cfgs}

    return measure


TOLERANCE = 0.30
"""Relative error of the simulated median iteration time allowed on the real runs: the runs
last a fraction of a second per iteration on a shared 2-core machine."""


def _simulation_errors(measured_runs: dict[str, MeasuredRun]) -> list[str]:
    """What misses the tolerance: in sample (both runs calibrate), and out of sample (calibrated
    on sync-separated alone, whose phases are measured one at a time, the simulator predicts
    the overlap of periodic-async, with the contention of two busy workers unknown)."""
    errors = []
    costs = fit_costs(list(measured_runs.values()), host_cores=os.cpu_count())
    assert math.isfinite(costs.contention)
    for name, r in measured_runs.items():
        assert len(r.iterations) == 3
        sim = statistics.median(s.iteration_s for s in simulate_measured(r, costs))
        meas = statistics.median(it.metrics["time/iteration_s"] for it in r.iterations)
        if abs(sim / meas - 1) > TOLERANCE:
            errors.append(f"{name}: simulated {sim:.3f}s, measured {meas:.3f}s")
    sync_only = fit_costs([measured_runs["sync-separated"]], host_cores=os.cpu_count())
    r = measured_runs["periodic-async"]
    sim = statistics.median(s.iteration_s for s in simulate_measured(r, sync_only))
    meas = statistics.median(it.metrics["time/iteration_s"] for it in r.iterations)
    if abs(sim / meas - 1) > 2 * TOLERANCE:
        errors.append(f"out of sample: simulated {sim:.3f}s, measured {meas:.3f}s")
    return errors


def test_simulator_matches_measured(measure_runs):
    # The default suite runs two test processes on two cores: a load that changes between the
    # two runs (the other process starting or ending a test) moves one run's times and not the
    # other's, which no calibration can fit. A miss is measured once more; two misses fail.
    errors = _simulation_errors(measure_runs())
    if errors:
        errors = _simulation_errors(measure_runs())
    assert not errors, "; ".join(errors)
