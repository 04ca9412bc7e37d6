"""Task sources (data.source: reasoning-gym:NAME, data/reasoning_tasks.py): entries reproducible
from the config, held-out disjoint from training, the reward equal to the task's own verifier,
the warm start's targets; a warm start, a training run (re-scored with reasoning-gym) and the eval
command on a composite of two tasks; one-line errors for bad input; the TRL drop-in example.
Checked against reasoning-gym called directly."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")
import reasoning_gym  # noqa: E402
from reasoning_gym.composite import DatasetSpec  # noqa: E402
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402
from helpers import script_env  # noqa: E402

from periodic_async.config import RunConfig, SFTRunConfig, load_config  # noqa: E402
from periodic_async.data import DataError, load_examples, prompt_messages, reward_kwargs  # noqa: E402
from periodic_async.reward import make_accuracy, make_reward, task_accuracy, task_reward  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARITH = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"]}
CHAIN = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
COMPOSITE = {"datasets": [{"name": "basic_arithmetic", "weight": 1, "config": ARITH},
                          {"name": "chain_sum", "weight": 1, "config": CHAIN}]}


def _data(task: str, config: dict | None = None, **extra) -> RunConfig:
    settings = [f"data.source=reasoning-gym:{task}", f"data.task_config={json.dumps(config or {})}",
                *(f"{k}={v}" for k, v in extra.items())]
    return load_config(RunConfig, None, settings)


def test_entries_are_reasoning_gyms_from_the_config_alone():
    """Training entry i is create_dataset(NAME, seed=data.seed, size=data.num_train, **task_config)[i];
    the prompt is its question under SYSTEM_PROMPTS['default']; the default reward and accuracy
    are the task's. Negative control: another data.seed gives other entries."""
    cfg = _data("gsm_symbolic", **{"data.num_train": 12, "data.num_eval": 4, "data.seed": 7})
    train = load_examples(cfg.data, "train")
    direct = reasoning_gym.create_dataset("gsm_symbolic", seed=7, size=12)
    assert [(e.question, e.answer) for e in train] == [(direct[i]["question"], direct[i]["answer"]) for i in range(12)]
    assert [(e.columns["source_dataset"], e.columns["source_index"]) for e in train] == \
        [("gsm_symbolic", i) for i in range(12)]
    assert prompt_messages(train[0], data=cfg.data) == [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
                                                        {"role": "user", "content": direct[0]["question"]}]
    assert cfg.reward.functions == ["periodic_async.reward:task_reward"]
    assert cfg.reward.accuracy_function == "periodic_async.reward:task_accuracy"
    own = _data("gsm_symbolic", **{"data.num_train": 12, "data.system_prompt": "Be brief."}).data
    assert prompt_messages(train[0], data=own)[0] == {"role": "system", "content": "Be brief."}
    other = load_examples(_data("gsm_symbolic", **{"data.num_train": 12, "data.seed": 8}).data, "train")
    assert [e.question for e in other] != [e.question for e in train]


def test_held_out_entries_are_disjoint_from_training(capsys):
    """Held-out entries come from seed + 1, skipping training questions: basic_arithmetic seeds
    entry i with seed + i, so seed + 1 repeats the training entries shifted by one; the held-out
    set still has num_eval entries, none a training question, and the count skipped is printed.
    Negative control: the seed + 1 entries taken as they are overlap training almost entirely."""
    cfg = _data("basic_arithmetic", ARITH, **{"data.num_train": 40, "data.num_eval": 10})
    train, held = load_examples(cfg.data, "train"), load_examples(cfg.data, "eval")
    questions = {e.question for e in train}
    assert len(held) == 10 and not any(e.question in questions for e in held)
    raw = reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=10, **ARITH)
    assert sum(raw[i]["question"] in questions for i in range(10)) >= 9
    assert "skipped" in capsys.readouterr().out
    first = held[0]
    spec = json.loads(first.columns["task_spec"])
    assert spec["seed"] == 1 and reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=spec["size"], **ARITH)[
        first.columns["task_index"]]["question"] == first.question


@pytest.mark.parametrize("task", ["basic_arithmetic", "gsm_symbolic"])
def test_reward_is_the_tasks_own_verifier(task):
    """Hand-made completions: the answer in tags (1), a wrong answer (0, gsm_symbolic's 0.01), no
    tags (0 even with the right answer), a partial answer (basic_arithmetic's credit len(answer) /
    len(text)): task_reward equals score_answer(extract_answer(.), entry) of reasoning-gym called
    directly (and through the reward worker); task_accuracy counts full credit only."""
    cfg = _data(task, ARITH if task == "basic_arithmetic" else {}, **{"data.num_train": 5, "data.num_eval": 0})
    example = load_examples(cfg.data, "train")[3]
    entry = reasoning_gym.create_dataset(task, seed=0, size=5, **(ARITH if task == "basic_arithmetic" else {}))[3]
    right = entry["answer"]
    wrong = str(int(right) + 1)
    completions = [f"Thinking.\n<answer>{right}</answer>", f"<answer>{wrong}</answer>", f"The answer is {right}.",
                   f"<answer>9{right}</answer>"]
    expected = [reasoning_gym.get_score_answer_fn(task)(extract_answer(c), entry) for c in completions]
    kwargs = reward_kwargs([example] * 4)
    scores = task_reward(["p"] * 4, completions, **kwargs)
    assert scores == expected
    assert scores[:3] == [1.0, 0.01 if task == "gsm_symbolic" else 0.0, 0.0]
    if task == "basic_arithmetic":
        assert scores[3] == pytest.approx(len(right) / (len(right) + 1)) and 0 < scores[3] < 1
    assert task_accuracy(["p"] * 4, completions, **kwargs) == [1.0, 0.0, 0.0, 0.0]
    if task != "basic_arithmetic":
        return
    in_worker, accuracy = make_reward(cfg.reward), make_accuracy(cfg.reward)  # reward.timeout_s > 0: the worker
    try:
        assert in_worker(["p"] * 4, completions, **kwargs) == expected
        assert accuracy(["p"] * 4, completions, **kwargs) == [1.0, 0.0, 0.0, 0.0]
    finally:
        in_worker.close()
        accuracy.close()


def test_every_reasoning_gym_task_loads_and_scores_as_its_verifier():
    """Every task in reasoning-gym's registry (not only the two this repository measures): its
    training and held-out entries load from the config, every column of an Example survives
    JSON (rollouts.jsonl), and task_reward of the entry's own answer in tags equals
    score_answer(extract_answer(.), entry) of reasoning-gym called directly, 1.0 wherever the
    entry has an answer (some tasks have none: their verifier checks a solution). Negative control:
    an empty answer in tags scores below the gold one on every task that has an answer."""
    from reasoning_gym.factory import DATASETS

    tasks = sorted(set(DATASETS) - {"composite"})  # composite: test_training_rollouts_rescore_with_reasoning_gym
    assert len(tasks) >= 90
    scored = 0
    for task in tasks:
        cfg = _data(task, **{"data.num_train": 2, "data.num_eval": 1}).data
        train = load_examples(cfg, "train")
        assert len(train) == 2 and len(load_examples(cfg, "eval")) == 1, task
        json.dumps([e.columns for e in train])
        entries = reasoning_gym.create_dataset(task, seed=cfg.seed, size=2)
        gold = [f"<answer>{e['answer']}</answer>" for e in entries]
        empty = ["<answer></answer>"] * 2
        verifier = reasoning_gym.get_score_answer_fn(task)
        got = task_reward(["p"] * 2, gold, **reward_kwargs(train))
        assert got == [verifier(extract_answer(c), e) for c, e in zip(gold, entries)], task
        if all(e["answer"] is not None for e in entries):
            assert got == [1.0, 1.0], task
            assert all(s < 1.0 for s in task_reward(["p"] * 2, empty, **reward_kwargs(train))), task
            scored += 1
    assert scored >= len(tasks) - 8


def test_warm_start_targets_with_and_without_a_worked_solution(tokenizer):
    """The sft target is metadata['answer_cot'] then the tagged answer (gsm_symbolic), or the
    tagged answer alone (basic_arithmetic has no worked solution); tokenize_sft trains on it."""
    from periodic_async.sft import tokenize_sft

    gsm = load_examples(_data("gsm_symbolic", **{"data.num_train": 3}).data, "train")
    entry = reasoning_gym.create_dataset("gsm_symbolic", seed=0, size=3)[1]
    assert gsm[1].solution == f"{entry['metadata']['answer_cot']}\n<answer>{entry['answer']}</answer>"
    assert extract_answer(gsm[1].solution) == entry["answer"]
    arith = load_examples(_data("basic_arithmetic", ARITH, **{"data.num_train": 3}).data, "train")
    assert arith[0].solution == f"<answer>{arith[0].answer}</answer>"
    pairs = tokenize_sft(tokenizer, arith, [], _data("basic_arithmetic", ARITH).data)
    assert tokenizer.decode(pairs[0][1][:-1]) == arith[0].solution and pairs[0][1][-1] == tokenizer.eos_token_id


# --- the command line on a composite task source: warm start, train, eval, re-score -----------------------

def _cli(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**script_env(), "PYTHONWARNINGS": "ignore"}
    env.pop("PERIODIC_ASYNC_DEBUG", None)
    out = subprocess.run([sys.executable, "-m", "periodic_async", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=900)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def composite_run(tokenizer_dir, tmp_path_factory):
    """A warm start on the composite's training entries (a tiny preset learns the tags), then 2
    periodic-async iterations from it: the `sft` and `train` commands' configs, run in this process
    (the `eval` test runs a real `python -m periodic_async`). A short system prompt keeps it quick."""
    import torch

    from periodic_async.pipeline import run
    from periodic_async.sft import run_sft

    tmp = tmp_path_factory.mktemp("composite")
    data = ["data.source=reasoning-gym:composite", f"data.task_config={json.dumps(COMPOSITE)}",
            "data.system_prompt=Answer as <answer>N</answer>.", "data.num_train=200", "data.num_eval=12",
            "logging.wandb_mode=disabled", "logging.progress=false"]
    threads = torch.get_num_threads()  # sft.threads sets torch's: restored for the tests after this one
    try:
        run_sft(load_config(SFTRunConfig, None, [
            f"model.tokenizer={tokenizer_dir}", *data, "sft.max_steps=40", "sft.batch_size=16", "sft.lr=3e-3",
            "sft.warmup_steps=5", "sft.threads=1", f"sft.output_dir={tmp / 'sft'}"]))
    finally:
        torch.set_num_threads(threads)
    run(load_config(RunConfig, None, [
        f"model.name_or_path={tmp / 'sft'}", *data, "engine.backend=local", "engine.max_tokens=12",
        "algorithm.group_size=3", "algorithm.prompts_per_iteration=6", "trainer.iterations=2", "trainer.eval_every=1",
        "trainer.threads_after_generation=0", f"trainer.output_dir={tmp / 'run'}"]))
    return tmp


def test_sft_on_a_task_source_learns_the_tags(composite_run):
    summary = json.loads((composite_run / "sft" / "sft_summary.json").read_text())
    assert summary["eval_n"] == 12 and summary["steps"] == 40
    samples = [json.loads(line) for line in (composite_run / "sft" / "eval_samples.jsonl").read_text().splitlines()]
    assert sum(extract_answer(s["completion"]) is not None for s in samples) >= len(samples) // 2, samples[:3]


def test_training_rollouts_rescore_with_reasoning_gym(composite_run):
    """Every logged reward equals reasoning-gym's score of its completion, the entry found from the
    config and the row's source_index; training reward and held-out accuracy are reported per task."""
    run = composite_run / "run"
    cfg = load_config(RunConfig, run / "config.yaml")
    specs = [DatasetSpec(d["name"], d["weight"], d["config"]) for d in cfg.data.task_config["datasets"]]
    ds = reasoning_gym.create_dataset("composite", seed=cfg.data.seed, size=cfg.data.num_train, datasets=specs)
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 6
    rewards = []
    for r in rows:
        entry = ds[r["source_index"]]
        assert entry["metadata"]["source_dataset"] == r["source_dataset"]
        expected = [ds.score_answer(extract_answer(t), entry) for t in r["texts"]]
        assert r["rewards"] == pytest.approx(expected, abs=1e-12)
        rewards += r["rewards"]
    assert any(x > 0 for x in rewards), "the warm-started model must score somewhere, or this proves little"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    names = {r["source_dataset"] for r in rows}
    assert names == {"basic_arithmetic", "chain_sum"}
    assert all(f"reward/mean/{n}" in metrics[0] for n in names)
    assert any(f"eval/accuracy/{n}" in m for m in metrics for n in names)


def test_eval_command_on_a_task_source(composite_run):
    """`eval` takes the run's config and its checkpoint with its own max_tokens and writes the
    accuracy with its standard error, overall and per task (full credit only)."""
    run = composite_run / "run"
    out = _cli("eval", "--config", str(run / "config.yaml"), f"eval.checkpoint={run}", "eval.max_tokens=16",
               f"eval.output={composite_run / 'eval.csv'}", cwd=composite_run)
    summary = json.loads(out.stdout[out.stdout.index("{\n"):])
    assert summary["model"] == str(run / "checkpoint") and summary["max_tokens"] == 16 and summary["n"] == 12
    rows = {r["task"]: r for r in csv.DictReader((composite_run / "eval.csv").open())}
    assert set(rows) == {"all", "basic_arithmetic", "chain_sum"}
    assert sum(int(rows[t]["n"]) for t in ("basic_arithmetic", "chain_sum")) == 12
    for r in rows.values():
        p, n = float(r["accuracy"]), int(r["n"])
        assert float(r["stderr"]) == pytest.approx(math.sqrt(p * (1 - p) / n))


# --- bad input: one line, naming the field ----------------------------------------------------------------

@pytest.mark.parametrize("task, config, message", [
    ("basic_arithmetc", {}, "reasoning-gym has no task 'basic_arithmetc'; did you mean basic_arithmetic"),
    ("basic_arithmetic", {"min_term": 2}, "'basic_arithmetic' has no field(s) min_term; its fields: min_terms, "),
    ("basic_arithmetic", {"min_terms": 0}, "data.task_config={'min_terms': 0}: reasoning-gym refused it: "
                                           "min_terms must be positive"),
    ("basic_arithmetic", {"seed": 3}, "seed come(s) from data.seed"),
    ("composite", {"datasets": [{"name": "chain_sun", "weight": 1}]}, "'chain_sun' is not a reasoning-gym task; "
                                                                       "did you mean chain_sum"),
])
def test_bad_task_input_is_one_line_naming_the_field(task, config, message):
    with pytest.raises(DataError) as e:
        load_examples(_data(task, config, **{"data.num_train": 4}).data, "train")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_package_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an environment without it imports
    with pytest.raises(DataError, match=r"pip install 'periodic-async\[tasks\]'"):
        load_examples(_data("basic_arithmetic", **{"data.num_train": 4}).data, "train")


def test_trl_drop_in_script_trains_on_a_reasoning_gym_task(tmp_path, tokenizer_dir, ray_session):
    """examples/trl_reasoning_gym.py, TRL-shaped with one import line naming us, trains two steps
    of a tiny preset on a reasoning-gym task."""
    from periodic_async.config import ModelConfig
    from periodic_async.model import load_policy

    script = ROOT / "examples" / "trl_reasoning_gym.py"
    ours = [ln for ln in script.read_text().splitlines() if ln.startswith(("from periodic_async", "import periodic"))]
    assert ours == ["from periodic_async import GRPOConfig, GRPOTrainer"]
    policy, tok = load_policy(ModelConfig(name_or_path="qwen2-1m", tokenizer=str(tokenizer_dir), seed=1))
    policy.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = subprocess.run([sys.executable, str(script), "--model", str(tmp_path / "model"), "--max-steps", "2",
                          "--train-size", "16", "--num-generations", "2", "--prompts-per-step", "2",
                          "--max-completion-length", "8", "--output-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path, env=script_env(ray_session))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "global_step=2" in out.stdout and (tmp_path / "run" / "final" / "model.safetensors").is_file()
