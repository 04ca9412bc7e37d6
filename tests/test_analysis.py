"""What the experiments compute from their runs (bench/analysis.py), on hand-made traces,
rollouts and records whose answers are known: Figure 1's phases and orders, the comparison of
two runs from one seed, the paired standard error of an accuracy gain, the overlap bound, and
the memory slope of a long run."""

import json
import math
import statistics

import pytest

from periodic_async.bench.analysis import (compare_iteration, identical_iterations, iteration_phases, max_abs_diff,
                                           memory_growth, overlap_bound, paired_gain_stderr, trained_orders)


def _gen(request: str, start: float, end: float) -> dict:
    return {"name": "generate", "track": "worker0/slot00", "start": start, "dur": end - start,
            "args": {"request": request, "prompt": 7}}


def _step(iteration: int, start: float) -> dict:
    return {"name": "micro_step", "track": "trainer", "start": start, "dur": 0.1, "args": {"iteration": iteration}}


def _sync(version: int, start: float) -> dict:
    return {"name": "weight_sync", "track": "trainer", "start": start, "dur": 0.5, "args": {"version": version}}


def test_iteration_phases_time_each_iteration_from_its_weight_sync():
    events = [_sync(0, 0.0),
              _gen("it0-p5-0", 1.0, 2.0), _gen("it0-p5-0", 1.0, 3.0), _gen("it0-p9-1", 1.0, 4.0),  # 2 samples, 1
              _step(0, 3.2), _step(0, 4.5), _sync(1, 5.0),
              _gen("it1-p2-0", 5.6, 6.0), _step(1, 7.0), _sync(2, 8.0)]
    it0, it1 = iteration_phases(events)
    assert it0 == {"iteration": 0, "wall_s": 5.0, "first_group_s": 2.5, "train_start_s": 2.7, "generation_s": 3.5,
                   "trains_while_generating": True}  # a group is done when its last sample is
    assert it1["trains_while_generating"] is False and it1["wall_s"] == 3.0


def test_trained_orders_number_requests_by_dataset_position():
    rows = [{"iteration": 0, "arrival": a, "position": p} for a, p in enumerate([3, 1, 0, 2])]
    rows += [{"iteration": 1, "arrival": 1, "position": 1}, {"iteration": 1, "arrival": 0, "position": 0}]
    assert trained_orders(rows) == {0: "4 2 1 3", 1: "1 2"}


def test_compare_iteration_matches_samples_by_prompt_and_index():
    sync = [{"prompt_index": 4, "arrival": 0, "response_ids": [[1, 2], [3]]},
            {"prompt_index": 8, "arrival": 1, "response_ids": [[5], [6, 7]]}]
    same_other_order = [{**sync[1], "arrival": 0}, {**sync[0], "arrival": 1}]
    assert compare_iteration(sync, same_other_order) == {
        "samples": 4, "identical_samples": 4, "identical_fraction": 1.0, "trained_in_other_order": True}
    one_differs = [sync[0], {**sync[1], "response_ids": [[5], [6, 9]]}]
    assert compare_iteration(sync, one_differs)["identical_fraction"] == 0.75


def test_identical_iterations_count_from_the_first_until_one_differs(tmp_path):
    def write(name, rows):
        (tmp_path / name).mkdir()
        with (tmp_path / name / "rollouts.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    a = [{"iteration": it, "prompt_index": p, "response_ids": [[it, p]]} for it in range(3) for p in range(2)]
    b = [dict(r, response_ids=[[9]]) if (r["iteration"], r["prompt_index"]) == (1, 1) else r for r in a]
    write("a", a), write("b", b)
    assert identical_iterations(tmp_path / "a", tmp_path / "b") == "1/3"  # iteration 2 agrees again: not counted
    assert identical_iterations(tmp_path / "a", tmp_path / "a") == "3/3"


def test_max_abs_diff_skips_rows_without_a_value():
    a = [{"r": 0.5}, {"r": ""}, {"r": 0.25}]
    b = [{"r": 0.4}, {"r": 0.9}, {"r": 0.5}]
    assert max_abs_diff(a, b, "r") == pytest.approx(0.25)
    assert max_abs_diff([{"r": ""}], [{"r": 1.0}], "r") is None


def test_paired_gain_stderr(tmp_path):
    """The gain's paired standard error is sd(d)/sqrt(n) over per-problem differences d."""
    start, end = [1, 0, 1, 0, 0, 1], [1, 1, 1, 0, 1, 0]
    with (tmp_path / "eval.jsonl").open("w") as f:
        for step, correct in ((0, start), (10, end)):
            f.write(json.dumps({"step": step, "accuracy": sum(correct) / 6, "correct": correct}) + "\n")
    d = [b - a for a, b in zip(start, end)]
    assert paired_gain_stderr(tmp_path, 0, 10) == pytest.approx(statistics.stdev(d) / len(d) ** 0.5)
    assert paired_gain_stderr(tmp_path, 0, 20) is None  # no such version


def test_overlap_bound_is_two_for_equal_phases_and_one_when_a_phase_is_everything():
    assert overlap_bound(3.0, 3.0) == 2.0  # the paper's bound of 2x
    assert overlap_bound(4.0, 1.0) == overlap_bound(1.0, 4.0) == 1.25
    assert overlap_bound(5.0, 0.0) == 1.0
    with pytest.raises(ValueError, match="T_gen"):
        overlap_bound(0.0, 0.0)


def test_memory_growth_fits_each_process_after_its_warmup():
    """One line per process (a restarted worker is a new process), the RSS slope per 100
    iterations of a least-squares fit after the warm-up samples; a dead process's nan is skipped."""
    rows = [dict(leg=2, iteration=it, process="trainer", pid=10, rss_mib=400 + (50 if it == 60 else 0) + 0.3 * it)
            for it in range(60, 201, 10)]  # start-up bump at the first sample, then 30 MiB / 100 iterations
    rows += [dict(leg=2, iteration=it, process="worker1", pid=11 if it < 130 else 12,
                  rss_mib=300.0 if it != 120 else math.nan) for it in range(60, 201, 10)]
    summary = {(r["process"], r["pid"]): r for r in memory_growth(rows, warmup=10)}
    assert set(summary) == {("trainer", 10), ("worker1", 11), ("worker1", 12)}
    assert summary[("trainer", 10)]["rss_slope_mib_per_100_iterations"] == pytest.approx(30.0)
    assert summary[("worker1", 12)]["first_iteration"] == 130
    assert summary[("worker1", 11)]["last_iteration"] == 110  # the nan at 120 is not a sample
    assert summary[("worker1", 11)]["rss_slope_mib_per_100_iterations"] == pytest.approx(0.0)
