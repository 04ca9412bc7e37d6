"""Datasets: synthetic determinism and correctness, GSM8K/MATH/AIME loaders on local files; the
prompt template as configuration; every dataset column reaches the reward functions."""

import json
import re

import pytest

from periodic_async.config import ConfigError, DataConfig, RunConfig, load_config
from periodic_async.data import (DataError, encode_chat, few_shot_examples, iteration_prompts, load_examples,
                                 make_synthetic, prompt_messages, reward_kwargs)
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


def test_default_template_is_the_original_prompt():
    """The defaults reproduce, character for character, the one hard-coded prompt the committed results
    were made with: solved examples, then the question and its instruction, in one user turn."""
    shots = few_shot_examples(DataConfig(few_shot=2))
    ex = make_synthetic(1, DataConfig(), 5)[0]
    original = "\n".join([f"{s.question}\n{s.solution}\n" for s in shots] +
                         [f"{ex.question}\nSolve step by step and give the final answer after ####."])
    assert prompt_messages(ex, shots) == [{"role": "user", "content": original}]
    assert prompt_messages(ex, shots, DataConfig()) == prompt_messages(ex, shots)


def test_prompt_template_is_configuration(tmp_path, tokenizer):
    """System prompt first; instruction and question template with a dataset column; few-shot as
    user/assistant turns; all through the tokenizer's chat template."""
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"question": "How many legs has a cat?", "answer": "so\n#### 4", "topic": "animals"}))
    ex = load_examples(DataConfig(source=str(p)))[0]
    shots = few_shot_examples(DataConfig(few_shot=2))
    data = DataConfig(system_prompt="You are a careful tutor.", instruction="Reply with \\boxed{N}.",
                      question_template="[{topic}] {question} {instruction}")
    msgs = prompt_messages(ex, [], data)
    assert msgs == [{"role": "system", "content": "You are a careful tutor."},
                    {"role": "user", "content": "[animals] How many legs has a cat? Reply with \\boxed{N}."}]
    text = tokenizer.decode(encode_chat(tokenizer, msgs))
    assert text.startswith("You are a careful tutor.\n<|user|>[animals] How many legs")
    assert text.endswith("<|assistant|>")
    turns = prompt_messages(make_synthetic(1, DataConfig(), 9)[0], shots,
                            DataConfig(few_shot_format="turns", system_prompt="S"))
    assert [m["role"] for m in turns] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert turns[2]["content"] == shots[0].solution and turns[1]["content"].startswith(shots[0].question)
    assert all(s.solution not in turns[-1]["content"] for s in shots)
    # a placeholder the few-shot examples (synthetic: question, answer, solution, id) lack
    with pytest.raises(DataError, match=r"data.question_template=.*has no column 'topic'"):
        prompt_messages(ex, shots, DataConfig(few_shot_format="turns", question_template="[{topic}] {question}"))


@pytest.mark.parametrize("override,fragment", [
    ("data.question_template=Answer {answer}: {question}", "would put the ground truth in the prompt"),
    ("data.question_template=Solve it.", "needs the placeholder {question}"),
    ("data.question_template={question", "not a valid template"),
    ("data.question_template={question[0]}", "is not a plain name"),
    ("data.shot_template={question} {topic}", "unknown placeholder(s) {topic}"),
    ("data.few_shot_format=pairs", "expected inline or turns"),
    ("reward.accuracy_function=exact", "expected 'module:function'"),
])
def test_template_errors_name_the_field(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, None, [override])
    assert str(e.value).startswith(override.split("=")[0] + "=") and fragment in str(e.value)


def test_reward_kwargs_carry_every_column(tmp_path):
    """TRL's convention: every column, one value per completion, `answer` the parsed ground truth;
    a column a record lacks is None; the positional names and TRL's keys are not passed."""
    p = tmp_path / "g.jsonl"
    rows = [{"question": "Q1?", "answer": "2+2\n#### 4", "level": 1, "prompt": "x"},
            {"question": "Q2?", "answer": "so\n#### 1,200", "tags": ["a"]}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    exs = load_examples(DataConfig(source=str(p)))
    kw = reward_kwargs([exs[0], exs[0], exs[1]])
    assert kw == {"question": ["Q1?", "Q1?", "Q2?"], "answer": ["4", "4", "1200"], "level": [1, 1, None],
                  "tags": [None, None, ["a"]]}
    syn = make_synthetic(1, DataConfig(), 0)[0]
    assert reward_kwargs([syn]) == {"question": [syn.question], "answer": [syn.answer], "solution": [syn.solution],
                                    "id": [syn.id]}


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


# --- bad input: every error names the file and the 1-based line or row ------------------------

def _jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    from periodic_async.data import DataError

    src = _jsonl(tmp_path / "bad.jsonl", [json.dumps({"question": "Q", "answer": "#### 1"}), "", '{"question": "Q2",'])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        load_examples(DataConfig(source=src))


def test_malformed_json_file_names_file_and_line(tmp_path):
    from periodic_async.data import DataError

    p = tmp_path / "bad.json"
    p.write_text('[\n  {"question": "Q", "answer": "#### 1"},\n  {"question": oops}\n]\n')
    with pytest.raises(DataError, match=r"bad\.json:3: invalid JSON"):
        load_examples(DataConfig(source=str(p)))


@pytest.mark.parametrize("name", ["bad.jsonl", "bad.json"])
def test_undecodable_file_names_file_and_line(tmp_path, name):
    """A byte that is not UTF-8 (a latin-1 file) is a DataError naming the file and its line."""
    rows = [b'{"question": "1+1?", "answer": "#### 2"}', b'{"question": "caf\xe9: 2+2?", "answer": "#### 4"}']
    path = tmp_path / name
    path.write_bytes(b"\n".join(rows) + b"\n" if name.endswith("l") else b"[\n" + b",\n".join(rows) + b"\n]\n")
    line = 2 if name.endswith("l") else 3
    with pytest.raises(DataError, match=rf"{name}:{line}: not UTF-8 text \(byte b'\\xe9'"):
        load_examples(DataConfig(source=str(path), num_eval=0))


def test_missing_field_names_file_and_line_or_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from periodic_async.data import DataError

    src = _jsonl(tmp_path / "gsm.jsonl", [json.dumps({"question": "Q", "answer": "#### 1"}),
                                          json.dumps({"question": "Q2"})])
    with pytest.raises(DataError, match=r"gsm\.jsonl:2 \(format gsm8k\): missing field 'answer'"):
        load_examples(DataConfig(source=src, format="gsm8k"))
    p = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "P1", "answer": "1"}, {"problem": None, "answer": "2"}]), p)
    with pytest.raises(DataError, match=r"math\.parquet row 2 \(format aime\): missing field 'problem'/'Problem'"):
        load_examples(DataConfig(source=str(p), format="aime"))


def test_wrong_type_names_file_and_line_or_row(tmp_path):
    from periodic_async.data import DataError

    p = tmp_path / "list.json"
    p.write_text(json.dumps([{"question": "Q", "answer": "#### 1"}, {"question": ["not", "text"], "answer": "#### 2"}]))
    with pytest.raises(DataError, match=r"list\.json row 2 \(format gsm8k\): field 'question' is list"):
        load_examples(DataConfig(source=str(p), format="gsm8k"))
    src = _jsonl(tmp_path / "aime.jsonl", [json.dumps({"problem": "P", "answer": 3}),
                                           json.dumps({"problem": "P2", "answer": {"value": 4}})])
    with pytest.raises(DataError, match=r"aime\.jsonl:2 \(format aime\): field 'answer' is dict"):
        load_examples(DataConfig(source=src, format="aime"))
    src = _jsonl(tmp_path / "array.jsonl", [json.dumps(["Q", "#### 1"])])
    with pytest.raises(DataError, match=r"array\.jsonl:1: expected an object with question/answer fields, got list"):
        load_examples(DataConfig(source=src))


def test_empty_file_names_the_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from periodic_async.data import DataError

    blank = _jsonl(tmp_path / "blank.jsonl", ["", "  "])
    with pytest.raises(DataError, match=f"data.source '{re.escape(blank)}' .*has no examples"):
        load_examples(DataConfig(source=blank))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match=r"empty\.json' .*has no examples"):
        load_examples(DataConfig(source=str(tmp_path / "empty.json")))
    p = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), p)
    with pytest.raises(DataError, match=r"empty\.parquet' .*has no examples"):
        load_examples(DataConfig(source=str(p)))


def test_empty_dataset_split_names_the_source(tmp_path):
    from periodic_async.data import DataError

    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.jsonl").write_text(json.dumps({"question": "Q?", "answer": "#### 5"}) + "\n")
    (d / "test.jsonl").write_text("")
    with pytest.raises(DataError, match=f"data.source '{re.escape(str(d))}' \\(data.split 'test'\\) cannot be loaded"):
        load_examples(DataConfig(source=str(d), split="test"))


def test_prompt_longer_than_context(tmp_path, tokenizer_dir, tokenizer, capsys):
    """A prompt whose tokens + engine.max_tokens exceed the model's context stops the run at
    start-up naming the example and the numbers; with data.skip_too_long it is skipped and
    counted instead."""
    from periodic_async.config import RunConfig, load_config
    from periodic_async.data import DataError, fit_to_context
    from periodic_async.pipeline import run
    from periodic_async.data.prompts import encode_chat

    long_q = "Ava has 3 apples and " * 40 + "how many?"
    src = _jsonl(tmp_path / "q.jsonl", [json.dumps({"question": q, "answer": "#### 1"})
                                        for q in ("Q one?", long_q, "Q three?")])
    n_long = len(encode_chat(tokenizer, prompt_messages(load_examples(DataConfig(source=src))[1])))
    max_tokens = 8192 - 100  # the presets' context is 8192: room for a 100-token prompt
    assert n_long > 100
    cfg = load_config(RunConfig, None, [f"data.source={src}", "data.num_train=0", "data.num_eval=0",
                                        f"engine.max_tokens={max_tokens}", "engine.backend=local",
                                        f"model.tokenizer={tokenizer_dir}", "model.name_or_path=qwen2-micro",
                                        f"trainer.output_dir={tmp_path / 'run'}", "logging.wandb_mode=disabled"])
    with pytest.raises(DataError) as err:
        run(cfg)
    msg = str(err.value)
    assert msg.startswith("1 of 3 training prompts do not fit the model's context; the first: training example 1 "
                          f"({long_q[:60]!r}): "), msg
    assert (f"prompt of {n_long} tokens (chat template) + engine.max_tokens={max_tokens} = {n_long + max_tokens} > "
            "the model's context of 8192 tokens (max_position_embeddings)") in msg, msg
    assert "data.skip_too_long=true" in msg
    capsys.readouterr()
    kept = fit_to_context(load_examples(DataConfig(source=src)), [], tokenizer, max_tokens, 8192, skip=True)
    assert [e.question for e in kept] == ["Q one?", "Q three?"]
    assert capsys.readouterr().out.count("skipped 1 of 3 training examples too long") == 1
    assert fit_to_context(load_examples(DataConfig(source=src)), [], tokenizer, 16, 8192) == \
        load_examples(DataConfig(source=src))  # everything fits: nothing dropped


def test_encode_chats_is_encode_chat_of_each(tokenizer):
    """The batched encoding (start-up checks, SFT) gives each conversation's own ids."""
    from periodic_async.data import encode_chats

    cfg = DataConfig(few_shot=2)
    convs = [prompt_messages(e, few_shot_examples(cfg), cfg) for e in load_examples(DataConfig(num_train=5))]
    assert encode_chats(tokenizer, convs) == [encode_chat(tokenizer, m) for m in convs]
    assert encode_chats(tokenizer, []) == []


def test_data_is_loaded_once_per_process_until_its_file_changes(tmp_path, tokenizer_dir, tokenizer, monkeypatch):
    """A process that runs several times on the same data (a benchmark's systems) loads and checks
    it once; a changed data file, or other data settings, load anew."""
    from periodic_async import pipeline
    from periodic_async.model import load_policy

    calls = []
    monkeypatch.setattr(pipeline, "fit_to_context", lambda e, *a, **k: calls.append(len(e)) or list(e))
    src = tmp_path / "q.jsonl"
    _jsonl(src, [json.dumps({"question": f"Q{i}?", "answer": f"#### {i}"}) for i in range(3)])
    cfg = lambda *o: load_config(RunConfig, None, [f"data.source={src}", "data.num_train=0", "data.num_eval=0",  # noqa: E731
                                                   f"model.tokenizer={tokenizer_dir}", "model.name_or_path=qwen2-micro",
                                                   *o])
    policy, _ = load_policy(cfg().model)
    first = pipeline._load_data(cfg(), policy, tokenizer)
    again = pipeline._load_data(cfg(), policy, tokenizer)
    assert calls == [3, 0] and again[0] == first[0] and again[0] is not first[0]
    assert [e.question for e in pipeline._load_data(cfg("data.num_train=2"), policy, tokenizer)[0]] == ["Q0?", "Q1?"]
    _jsonl(src, [json.dumps({"question": f"R{i}?", "answer": f"#### {i}"}) for i in range(4)])
    assert [e.question for e in pipeline._load_data(cfg(), policy, tokenizer)[0]] == ["R0?", "R1?", "R2?", "R3?"]
