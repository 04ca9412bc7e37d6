"""The benchmark protocol (bench.py): interleaved order, warm-up excluded, median/min/max,
paired ratios, stable config hashes, and the CSV every throughput experiment writes."""

import csv

import pytest

from periodic_async.bench.protocol import Stats, System, config_hash, differing_settings, measure, schedule
from periodic_async.records import write_csv
from periodic_async.config import RunConfig, load_config
from periodic_async.records import git_commit


def _counter_system(name, calls, values, settings=None):
    """A real callable: records its call in the shared `calls` log and returns the next value."""
    it = iter(values)

    def run():
        calls.append(name)
        return {"tokens_per_s": next(it), "label": name}

    return System(name, run, settings)


def test_runs_are_interleaved_round_by_round_with_warmup_first():
    calls = []
    systems = [_counter_system(n, calls, range(100)) for n in ("A", "B", "C")]
    measure(systems, repeats=3, warmup_rounds=1, log=None)
    assert calls == ["A", "B", "C"] * 4
    assert schedule(["A", "B"], repeats=2, warmup_rounds=1) == [(-1, "A"), (-1, "B"), (0, "A"), (0, "B"),
                                                                 (1, "A"), (1, "B")]


def test_warmup_round_is_excluded_and_median_min_max_are_over_measured_rounds():
    calls = []
    a = _counter_system("A", calls, [1000.0, 4.0, 1.0, 9.0, 2.0])  # 1000 is the warm-up round
    results = measure([a], repeats=4, warmup_rounds=1, log=None)
    r = results["A"]
    assert r.repeats == 4
    assert r.stats("tokens_per_s") == Stats(median=3.0, min=1.0, max=9.0, n=4)
    row = r.row(["tokens_per_s"])
    assert (row["tokens_per_s"], row["tokens_per_s_min"], row["tokens_per_s_max"], row["repeats"]) == (3.0, 1.0,
                                                                                                      9.0, 4)


def test_paired_ratio_compares_the_same_round():
    calls = []
    a = _counter_system("A", calls, [2.0, 6.0, 10.0])
    b = _counter_system("B", calls, [1.0, 2.0, 5.0])
    res = measure([a, b], repeats=3, log=None)
    assert res["A"].ratio(res["B"]) == Stats(median=2.0, min=2.0, max=3.0, n=3)


def test_config_hash_is_stable_and_sensitive():
    cfg1 = load_config(RunConfig, None, ["algorithm.group_size=8"])
    cfg2 = load_config(RunConfig, None, ["algorithm.group_size=8"])
    cfg3 = load_config(RunConfig, None, ["algorithm.group_size=16"])
    assert config_hash(cfg1) == config_hash(cfg2)
    assert len(config_hash(cfg1)) == 12 and int(config_hash(cfg1), 16) >= 0
    assert config_hash(cfg1) != config_hash(cfg3)
    # key order of a plain dict does not matter, values do
    assert config_hash({"a": 1, "b": {"c": 2}}) == config_hash({"b": {"c": 2}, "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


def test_differing_settings_names_only_what_differs():
    sync = load_config(RunConfig, None, ["pipeline.mode=sync-colocated", "trainer.threads=2",
                                         "trainer.output_dir=runs/a"])
    asyn = load_config(RunConfig, None, ["pipeline.mode=periodic-async", "trainer.output_dir=runs/b"])
    diff = differing_settings({"sync": sync, "async": asyn}, ignore=["trainer.output_dir"])
    assert diff == {"sync": {"pipeline.mode": "sync-colocated", "trainer.threads": 2},
                    "async": {"pipeline.mode": "periodic-async", "trainer.threads": 1}}
    # a key only one system has is a difference too
    assert differing_settings({"x": {"k": 1}, "y": {}}) == {"x": {"k": 1}, "y": {}}


def test_rows_carry_commit_hash_and_settings_and_write_as_csv(tmp_path):
    calls = []
    systems = [_counter_system("A", calls, [1.0, 2.0, 3.0], {"lr": 1e-4, "mode": "a"}),
               _counter_system("B", calls, [4.0, 5.0, 6.0], {"lr": 1e-4, "mode": "b"})]
    res = measure(systems, repeats=3, log=None)
    rows = [{"system": n, **r.row(["tokens_per_s"]), **r.provenance()} for n, r in res.items()]
    path = write_csv(tmp_path / "sub" / "bench.csv", rows)
    back = list(csv.DictReader(path.open()))
    assert [r["system"] for r in back] == ["A", "B"]
    assert back[0]["git_commit"] == git_commit()
    assert back[0]["config_hash"] == config_hash({"lr": 1e-4, "mode": "a"}) != back[1]["config_hash"]
    assert back[0]["settings"] == "mode=a" and back[1]["settings"] == "mode=b"
    assert float(back[1]["tokens_per_s"]) == 5.0 and float(back[1]["tokens_per_s_max"]) == 6.0


def test_rejects_no_repeats_and_duplicate_names():
    with pytest.raises(ValueError, match="repeats"):
        schedule(["A"], repeats=0)
    with pytest.raises(ValueError, match="unique"):
        schedule(["A", "A"], repeats=1)


def test_equivalence_figure_draws_every_case():
    """One line per case in both panels, however many cases the CSV holds (the method's solid,
    the controls' dashed), from the committed results/equivalence.csv."""
    from pathlib import Path

    from periodic_async.bench.plots import equivalence_figure
    from periodic_async.records import read_csv

    rows = read_csv(Path(__file__).resolve().parents[1] / "results" / "equivalence.csv")
    cases = list(dict.fromkeys(r["case"] for r in rows))
    assert len(cases) > 5
    fig = equivalence_figure(rows)
    for ax in fig.axes:
        assert [line.get_label() for line in ax.get_lines()] == cases
        assert [line.get_linestyle() for line in ax.get_lines()] == ["--" if c.endswith("two-steps") else "-"
                                                                     for c in cases]
