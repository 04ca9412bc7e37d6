"""The measurements of experiments/fig1_timeline.py and experiments/equivalence.py, on hand-made
traces and rollouts whose answers are known (the scripts themselves run in minutes)."""


def _gen(request: str, start: float, end: float) -> dict:
    return {"name": "generate", "track": "worker0/slot00", "start": start, "dur": end - start,
            "args": {"request": request, "prompt": 7}}


def _step(iteration: int, start: float) -> dict:
    return {"name": "micro_step", "track": "trainer", "start": start, "dur": 0.1, "args": {"iteration": iteration}}


def _sync(version: int, start: float) -> dict:
    return {"name": "weight_sync", "track": "trainer", "start": start, "dur": 0.5, "args": {"version": version}}


def test_iteration_phases_time_each_iteration_from_its_weight_sync(experiment_script):
    fig1 = experiment_script("fig1_timeline")
    events = [_sync(0, 0.0),
              _gen("it0-p5-0", 1.0, 2.0), _gen("it0-p5-0", 1.0, 3.0), _gen("it0-p9-1", 1.0, 4.0),  # 2 samples, 1
              _step(0, 3.2), _step(0, 4.5), _sync(1, 5.0),
              _gen("it1-p2-0", 5.6, 6.0), _step(1, 7.0), _sync(2, 8.0)]
    it0, it1 = fig1.iteration_phases(events)
    assert it0 == {"iteration": 0, "wall_s": 5.0, "first_group_s": 2.5, "train_start_s": 2.7, "generation_s": 3.5,
                   "trains_while_generating": True}  # a group is done when its last sample is
    assert it1["trains_while_generating"] is False and it1["wall_s"] == 3.0


def test_trained_orders_number_requests_by_dataset_position(experiment_script):
    fig1 = experiment_script("fig1_timeline")
    rows = [{"iteration": 0, "arrival": a, "position": p} for a, p in enumerate([3, 1, 0, 2])]
    rows += [{"iteration": 1, "arrival": 1, "position": 1}, {"iteration": 1, "arrival": 0, "position": 0}]
    assert fig1.trained_orders(rows) == {0: "4 2 1 3", 1: "1 2"}


def test_compare_iteration_matches_samples_by_prompt_and_index(experiment_script):
    eq = experiment_script("equivalence")
    sync = [{"prompt_index": 4, "arrival": 0, "response_ids": [[1, 2], [3]]},
            {"prompt_index": 8, "arrival": 1, "response_ids": [[5], [6, 7]]}]
    same_other_order = [{**sync[1], "arrival": 0}, {**sync[0], "arrival": 1}]
    assert eq.compare_iteration(sync, same_other_order) == {
        "samples": 4, "identical_samples": 4, "identical_fraction": 1.0, "trained_in_other_order": True}
    one_differs = [sync[0], {**sync[1], "response_ids": [[5], [6, 9]]}]
    assert eq.compare_iteration(sync, one_differs)["identical_fraction"] == 0.75
