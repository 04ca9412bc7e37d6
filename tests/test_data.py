"""Datasets: synthetic determinism and correctness, GSM8K/MATH/AIME loaders on local files."""

import json
import re

import pytest

from periodic_async.config import DataConfig
from periodic_async.data import (few_shot_examples, iteration_prompts, load_examples, make_synthetic,
                                 prompt_messages)
from periodic_async.reward import correctness_reward


def _evaluate_solution(solution: str) -> int:
    """Independently re-check a synthetic solution: every line a=b must hold, chained."""
    value = None
    for line in solution.splitlines():
        if line.startswith("####"):
            return int(line[4:])
        lhs, rhs = line.split("=")
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", lhs).groups()
        assert value is None or int(a) == value, "steps must chain"
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert value == int(rhs)
    raise AssertionError("no final answer")


def test_synthetic_is_deterministic_and_seed_dependent():
    cfg = DataConfig(max_steps=3)
    assert make_synthetic(50, cfg, 1) == make_synthetic(50, cfg, 1)
    assert make_synthetic(50, cfg, 1) != make_synthetic(50, cfg, 2)


@pytest.mark.parametrize("steps,operand", [(1, 9), (3, 20), (4, 99)])
def test_synthetic_answers_are_correct_and_respect_difficulty(steps, operand):
    cfg = DataConfig(min_steps=steps, max_steps=steps, max_operand=operand)
    for ex in make_synthetic(200, cfg, 0):
        assert _evaluate_solution(ex.solution) == int(ex.answer) >= 0
        assert len([ln for ln in ex.solution.splitlines() if "=" in ln]) == steps
        assert correctness_reward(None, [ex.solution], answer=[ex.answer]) == [1.0]


def test_eval_disjoint_from_train(tmp_path):
    """The held-out set never shares a question with the training set (nor the few-shot prefix):
    - synthetic: on a small task the eval seed's raw stream repeats training problems, yet the
      held-out set has none of them and still num_eval problems; an impossible request is an
      error naming the source;
    - files and `datasets` directories: a training head and held-out tail that would share
      records, or a duplicated question across them, is an error naming the source, how many
      and which example."""
    cfg = DataConfig(num_train=2000, num_eval=100, min_steps=1, max_steps=1, max_operand=3, few_shot=2)
    train = {e.question for e in load_examples(cfg, "train") + few_shot_examples(cfg)}
    raw = make_synthetic(100, cfg, seed=cfg.seed + 1_000_003)
    assert sum(e.question in train for e in raw) >= 10, "the control must collide, or the test proves nothing"
    evals = load_examples(cfg, "eval")
    assert len(evals) == 100 and not any(e.question in train for e in evals)
    assert evals == load_examples(cfg, "eval")  # deterministic
    with pytest.raises(ValueError, match="synthetic.*only .* of data.num_eval=500"):
        load_examples(DataConfig(num_train=30000, num_eval=500, min_steps=1, max_steps=1, max_operand=2), "eval")

    rows = [{"question": f"Q{i}?", "answer": f"#### {i}"} for i in range(10)]
    p = tmp_path / "gsm8k.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    ok = load_examples(DataConfig(source=str(p), num_train=6, num_eval=4), "eval")
    assert [e.question for e in ok] == ["Q6?", "Q7?", "Q8?", "Q9?"]
    with pytest.raises(ValueError, match=r"gsm8k.jsonl.*10 examples.*would share 2"):
        load_examples(DataConfig(source=str(p), num_train=8, num_eval=4), "eval")
    with pytest.raises(ValueError, match=r"gsm8k.jsonl.*would share 4"):
        load_examples(DataConfig(source=str(p), num_train=0, num_eval=4), "eval")
    rows[8] = dict(rows[2], answer="#### 2")  # the same question again, in the held-out tail
    p.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"gsm8k.jsonl.*1 of 4 held-out examples.*'Q2\?'"):
        load_examples(DataConfig(source=str(p), num_train=6, num_eval=4), "eval")
    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.jsonl").write_text(p.read_text())
    with pytest.raises(ValueError, match=r"ds'.*1 of 4 held-out examples.*'Q2\?'"):
        load_examples(DataConfig(source=str(d), num_train=6, num_eval=4), "eval")


def test_few_shot_prompt_is_longer_and_contains_solved_examples():
    cfg = DataConfig(few_shot=3)
    shots = few_shot_examples(cfg)
    ex = load_examples(cfg, "train")[0]
    content = prompt_messages(ex, shots)[0]["content"]
    assert all(s.solution in content for s in shots) and content.endswith("after ####.")


def test_iteration_prompts_is_a_resumable_epoch_shuffle():
    exs = make_synthetic(10, DataConfig(), 0)
    first = [i for t in range(5) for i, _ in iteration_prompts(exs, t, 4, seed=3)]
    assert sorted(first[:10]) == list(range(10))  # the first epoch covers every prompt once
    assert [i for i, _ in iteration_prompts(exs, 3, 4, seed=3)] == first[12:16]  # resume at iteration 3


def test_gsm8k_jsonl(tmp_path):
    p = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "Q1?", "answer": "2+2 = <<2+2=4>>4\n#### 4"},
            {"question": "Q2?", "answer": "so\n#### 1,200"}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    exs = load_examples(DataConfig(source=str(p), num_train=0), "train")
    assert [(e.question, e.answer) for e in exs] == [("Q1?", "4"), ("Q2?", "1200")]
    assert "<<" not in exs[0].solution


def test_math_and_aime_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "1/2+0?", "solution": "It is \\boxed{\\frac{1}{2}}."}]), p)
    assert load_examples(DataConfig(source=str(p)), "train")[0].answer == "\\frac{1}{2}"
    q = tmp_path / "aime.jsonl"
    q.write_text(json.dumps({"Problem": "AIME?", "Answer": 204}) + "\n")
    assert load_examples(DataConfig(source=str(q), format="aime"), "train")[0].answer == "204"


def test_hf_datasets_path(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.jsonl").write_text(json.dumps({"question": "Q?", "answer": "#### 5"}) + "\n")
    exs = load_examples(DataConfig(source=str(d)), "train")
    assert exs[0].answer == "5"


def test_bad_files_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_examples(DataConfig(source=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "Q", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_examples(DataConfig(source=str(bad)))
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_examples(DataConfig(source=str(odd)))
    nohash = tmp_path / "nohash.jsonl"
    nohash.write_text(json.dumps({"question": "Q", "answer": "5"}) + "\n")
    with pytest.raises(ValueError, match=r"nohash.jsonl:1 \(format gsm8k\): GSM8K answer has no '####'"):
        load_examples(DataConfig(source=str(nohash), format="gsm8k"))
