"""The examples run, at a tiny size, as a user runs them: examples/capitals/ (the plug-in
example of docs/extending.md: data, reward, accuracy and YAML, through the pipeline in this
process), examples/trl_quickstart.py (TRL's GRPO quickstart with its import line switched to us)
and examples/trl_grpo.py (the script experiments/trl_dropin.py times), each as a process of its
own; and the TRL batch docs/trl.md shows. A random-weight qwen2-micro stands in for SmolLM2 (the
tiny presets' tokenizer has a chat template too); everything else is the example's own."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import save_preset, script_env

ROOT = Path(__file__).resolve().parents[1]
CAPITALS = ROOT / "examples" / "capitals"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_capitals_reward_and_accuracy_score_what_their_docstrings_say():
    """capital_reward: 1 for any alias anywhere in the completion, minus 0.001 a word;
    capital_accuracy: the completion starts with an alias (multi-word capitals too)."""
    from periodic_async.reward import load_reward_fn

    reward, accuracy = (load_reward_fn(f"{CAPITALS / 'capitals.py'}:{name}")
                        for name in ("capital_reward", "capital_accuracy"))
    names = [["Paris"], ["Mexico City", "Ciudad de México"], ["Lisbon", "Lisboa"], ["Paris"]]
    said = ["Paris.", "It is ciudad de méxico, of course", " lisboa", "Lyon"]
    assert reward(None, said, names) == pytest.approx([1 - 0.001, 1 - 0.007, 1 - 0.001, -0.001])
    assert accuracy(None, said, names) == [1.0, 0.0, 1.0, 0.0]
    assert accuracy(None, ["Mexico"], [["Mexico City"]]) == [0.0]  # the country is not its capital


def test_capitals_data_holds_one_capital_per_country():
    """20 countries, no question twice; every answer among its own aliases."""
    rows = _rows(CAPITALS / "capitals.jsonl")
    assert len(rows) == 20 and len({r["problem"] for r in rows}) == 20
    assert all(r["answer"] in r["aliases"] and r["country"] in r["problem"] for r in rows)


def test_capitals_yaml_trains_with_its_reward_and_holds_out_the_last_lines(tmp_path, tokenizer_dir, monkeypatch):
    """`python -m periodic_async train --config examples/capitals/capitals.yaml` (its config, loaded
    as the command line loads it, run from the repository root) on qwen2-micro: 2 iterations of 4
    prompts x 4 samples from the first 16 lines, every sample's reward equal to the capitals reward
    recomputed here from its text and the line's aliases, the last 4 lines held out and evaluated at
    versions 0, 1 and 2."""
    from periodic_async.config import RunConfig, load_config
    from periodic_async.pipeline import run

    monkeypatch.chdir(ROOT)  # the YAML's paths are relative to the repository root
    cfg = load_config(RunConfig, "examples/capitals/capitals.yaml", [
        "model.name_or_path=qwen2-micro", f"model.tokenizer={tokenizer_dir}", "engine.backend=local",
        f"trainer.output_dir={tmp_path}", "logging.wandb_mode=disabled", "logging.progress=false"])
    assert cfg.reward.functions == ["examples/capitals/capitals.py:capital_reward"]
    summary = run(cfg)
    assert summary["iterations"] == 2

    lines = _rows(CAPITALS / "capitals.jsonl")
    aliases = {r["answer"]: r["aliases"] for r in lines}
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 4 and all(len(r["texts"]) == 4 for r in rollouts)
    assert {r["answer"] for r in rollouts} <= {r["answer"] for r in lines[:16]}
    for r in rollouts:
        expected = [float(any(a.lower() in t.lower() for a in aliases[r["answer"]])) - 0.001 * len(t.split())
                    for t in r["texts"]]
        assert r["rewards"] == pytest.approx(expected, abs=1e-9)
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["n"]) for e in evals] == [(0, 4), (1, 4), (2, 4)]


def test_extending_md_shows_the_capitals_prompt():
    """docs/extending.md's prompt is the first capitals problem through capitals.yaml's template:
    its system and user turns; with SmolLM2 prepared, the whole text through SmolLM2's chat template."""
    from periodic_async.config import RunConfig, load_config
    from periodic_async.data.prompts import prompt_messages
    from periodic_async.data.tasks import load_examples

    doc = (ROOT / "docs" / "extending.md").read_text()
    shown = doc.split("With SmolLM2 the first problem's prompt becomes", 1)[1].split("```\n", 2)[1]
    cfg = load_config(RunConfig, CAPITALS / "capitals.yaml", [f"data.source={CAPITALS / 'capitals.jsonl'}"])
    messages = prompt_messages(load_examples(cfg.data, "train")[0], data=cfg.data)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert all(f"{m['content']}<|im_end|>" in shown for m in messages)
    smollm2 = ROOT / "artifacts" / "smollm2-135m-instruct"
    if (smollm2 / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        text = AutoTokenizer.from_pretrained(smollm2).apply_chat_template(messages, tokenize=False,
                                                                          add_generation_prompt=True)
        assert text == shown


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory, tokenizer_dir):
    """qwen2-micro (random weights) with the tiny presets' tokenizer, as a model directory."""
    return save_preset(tmp_path_factory.mktemp("qwen2-micro"), "qwen2-micro", tokenizer_dir)


def _run_example(script: str, *args: str, ray=None) -> str:
    """`python examples/SCRIPT ARGS` from the repository root, as a user runs it (joining the test
    process's Ray when given it: helpers.script_env); its stdout."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=script_env(ray))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_trl_quickstart_trains_with_trls_accuracy_reward(tmp_path, micro_model_dir, ray_session):
    """examples/trl_quickstart.py, TRL's quickstart whose one import line names us, trains 2 steps
    of 8 prompts x 4 completions with TRL's own `accuracy_reward` scoring each against the
    dataset's `solution` (0.0, not None: the solution parsed; the random model answers nothing)."""
    pytest.importorskip("trl")
    script = ROOT / "examples" / "trl_quickstart.py"
    assert "from periodic_async import GRPOConfig, GRPOTrainer  # TRL's quickstart: from trl import GRPOTrainer" \
        in script.read_text()
    _run_example("trl_quickstart.py", "--model", str(micro_model_dir), "--max-steps", "2",
                 "--max-completion-length", "8", "--output-dir", str(tmp_path), ray=ray_session)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["mode"] == "periodic-async"
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 8 and all(len(r["texts"]) == 4 for r in rollouts)
    assert all(x == 0.0 for r in rollouts for x in r["rewards"])
    assert not math.isnan(summary["reward_last"])


def test_trl_dropin_script_trains_and_reports_its_step_times(tmp_path, micro_model_dir, ray_session):
    """examples/trl_grpo.py, the script experiments/trl_dropin.py times on TRL and on us, trains 3
    steps and saves; its STEP_TIMES line holds the median of the periods it measured."""
    out = _run_example("trl_grpo.py", "--model", str(micro_model_dir), "--max-steps", "3", "--num-generations", "2",
                       "--prompts-per-step", "2", "--max-completion-length", "8", "--output-dir", str(tmp_path),
                       ray=ray_session)
    assert "global_step=3 " in out and (tmp_path / "final" / "model.safetensors").is_file()
    times = json.loads(out.split("STEP_TIMES ", 1)[1].splitlines()[0])
    assert times["global_step"] == 3 and len(times["periods"]) == 1 and times["step_s"] == times["periods"][0] > 0


def test_trl_md_batch_overlaps_and_trls_default_does_not(tmp_path, monkeypatch):
    """docs/trl.md's GRPOConfig for overlap, run as written: B = 32 prompts x G = 8, one optimizer
    step per batch, B·G four times the engines' slots; TRL's default batch is one prompt of 8
    completions, within one worker's slots (one group: nothing to overlap)."""
    doc = (ROOT / "docs" / "trl.md").read_text().split("## The batch overlap needs", 1)[1]
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(code, scope)
    cfg = scope["args"].run_config(num_prompts=1000)
    slots = cfg.engine.num_workers * cfg.engine.max_num_seqs
    b, g = cfg.algorithm.prompts_per_iteration, cfg.algorithm.group_size
    assert (b, g, cfg.algorithm.optimizer_steps_per_iteration, slots) == (32, 8, 1, 64) and b * g == 4 * slots

    default = scope["GRPOConfig"](output_dir=str(tmp_path)).run_config(num_prompts=1000)
    assert default.algorithm.prompts_per_iteration == 1 and default.algorithm.group_size == 8
    assert 8 <= default.engine.num_workers * default.engine.max_num_seqs
