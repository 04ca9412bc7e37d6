"""Answer extraction and rewards: GSM8K strings, \\boxed{}, edge cases, user reward functions."""

import pytest

from periodic_async.reward import (answers_match, combined_reward, correctness_reward, extract_answer,
                                   format_reward, last_boxed, load_reward_fn, normalize_answer)

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("text,expected", [
    (GSM8K_ANSWER, "72"),
    ("so the total is\n#### 1,234", "1234"),
    ("#### -5", "-5"),
    ("#### 3.0", "3"),
    ("#### $12.50", "12.50"),
    ("#### +7.", "7"),
    ("first #### 3 then #### 4", "4"),
    ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("Thus \\boxed{1,000}", "1000"),
    ("3+4=7 and 7*2=14", "14"),
    ("no numbers here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed_nested_braces():
    assert last_boxed("\\boxed{1} then \\boxed{\\sqrt{2}+{3}}") == "\\sqrt{2}+{3}"
    assert last_boxed("\\boxed{unclosed") is None


def test_numeric_equivalence():
    assert answers_match("72", "72.00")
    assert answers_match("0.5", "1/2")
    assert not answers_match("72", "27")
    assert not answers_match(None, "1")
    assert normalize_answer(" $1,000.0 ") == "1000"


def test_correctness_and_format_rewards():
    comps = ["1+2=3\n#### 3", "#### 4", "the answer is 3", "nothing"]
    assert correctness_reward(None, comps, answer=["3"] * 4) == [1.0, 0.0, 1.0, 0.0]
    assert format_reward(None, comps) == [1.0, 1.0, 0.0, 0.0]


def test_correctness_length_mismatch_raises():
    with pytest.raises(ValueError):
        correctness_reward(None, ["#### 1"], answer=["1", "2"])


def test_user_reward_function_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def brevity(prompts, completions, **kw):\n    return [1.0 / (1 + len(c)) for c in completions]\n")
    fn = load_reward_fn(f"{f}:brevity")
    assert fn(None, ["a", "abc"]) == [0.5, 0.25]
    total = combined_reward([fn, load_reward_fn("periodic_async.reward:format_reward")], [2.0, 1.0])
    assert total(None, ["#### 1"], answer=["1"]) == [2.0 / 7 + 1.0]


@pytest.mark.parametrize("spec,why", [("nocolon", "expected 'module:function'"),
                                      ("missing_mod_xyz:f", "cannot import 'missing_mod_xyz'"),
                                      ("periodic_async.reward:nope", "no callable 'nope'"),
                                      ("/nonexistent/file.py:f", "does not exist")])
def test_bad_reward_spec_names_the_problem(spec, why):
    from periodic_async.config import UserError

    with pytest.raises(UserError, match=f"reward function '{spec}': .*{why}"):
        load_reward_fn(spec)


def test_reward_returning_wrong_length_is_caught():
    bad = combined_reward([lambda p, c, **k: [1.0]], [1.0])
    with pytest.raises(ValueError, match="returned 1 values for 2"):
        bad(None, ["a", "b"])


def test_math_reward_uses_symbolic_equivalence_when_available():
    pytest.importorskip("math_verify")
    comps = ["so \\boxed{\\frac{2}{4}}", "\\boxed{\\sqrt{4}}", "\\boxed{3}"]
    assert correctness_reward(None, comps, answer=["0.5", "2", "2"]) == [0.0, 0.0, 0.0]
    from periodic_async.reward import math_reward

    assert math_reward(None, comps, answer=["0.5", "2", "2"]) == [1.0, 1.0, 0.0]


def test_math_reward_in_thread():
    """Off the main thread (where rewards run: the producer thread) math_reward still uses
    math-verify's symbolic equivalence: answers only it accepts score 1, a wrong one 0, and no
    comparison failed or timed out (before, math-verify's signal timeout raised off the main
    thread and the failure was swallowed: every score below was 0)."""
    pytest.importorskip("math_verify")
    import threading

    from periodic_async.reward import math_reward, math_verify_stats

    comps = ["so \\boxed{\\frac{1}{2}}", "#### 0.5", "\\boxed{\\frac{1}{3}}", "\\boxed{2\\sqrt{2}}"]
    answers = ["0.5", "\\frac{1}{2}", "0.5", "\\sqrt{8}"]
    assert correctness_reward(None, comps, answer=answers) == [0.0, 0.0, 0.0, 0.0]
    before = math_verify_stats()
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(None, comps, answer=answers)))
    t.start()
    t.join(timeout=120)
    assert out == [[1.0, 1.0, 0.0, 1.0]]
    after = math_verify_stats()
    assert after["calls"] - before["calls"] == 4 and after["equal"] - before["equal"] == 3
    assert after["errors"] == before["errors"] and after["timeouts"] == before["timeouts"]


def test_bounded_worker_kills_a_call_that_overruns():
    """The worker that runs math-verify enforces its timeout from any thread: a call that runs
    too long raises TimeoutError within about its budget (the worker is killed), the next call
    gets a fresh worker, and an exception in the worker comes back as WorkerError."""
    import threading
    import time

    from periodic_async.reward import TimedWorker, WorkerError

    worker = TimedWorker()
    seen = {}

    def body():
        t0 = time.time()
        try:
            worker.call("time:sleep", 60, timeout_s=1.0)
        except TimeoutError:
            seen["timeout_after_s"] = time.time() - t0
        seen["sum"] = worker.call("operator:add", 2, 3, timeout_s=60)
        try:
            worker.call("math:sqrt", -1, timeout_s=60)
        except WorkerError as e:
            seen["error"] = str(e)

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=180)
    worker.close()
    assert 1.0 <= seen["timeout_after_s"] < 45  # not the 60 s the call sleeps
    assert seen["sum"] == 5
    assert seen["error"].startswith("ValueError")


def nan_reward(prompts, completions, **kwargs):
    return [float("nan")] + [1.0] * (len(completions) - 1)


def test_non_finite_or_malformed_reward_is_named():
    """A NaN, a non-number or a wrong count from a user reward stops with the function's name
    and the value, never as NaN advantages."""
    import pytest

    from periodic_async.reward import RewardError, combined_reward

    with pytest.raises(RewardError, match=r"'nan_reward' returned non-finite reward\(s\) nan \(completion 0\)"):
        combined_reward([nan_reward], [1.0])(["p"] * 3, ["a", "b", "c"])
    with pytest.raises(RewardError, match="'<lambda>' returned .*expected a list of numbers"):
        combined_reward([lambda p, c, **k: ["x"] * len(c)], [1.0])(["p"] * 2, ["a", "b"])
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        combined_reward([lambda p, c, **k: [1.0]], [1.0])(["p"] * 2, ["a", "b"])
    assert combined_reward([lambda p, c, **k: [0.5] * len(c)], [2.0])(["p"], ["a"]) == [1.0]


# --- through the producer: what a run sees when a user reward misbehaves ----------------------

SLOW = ("import time\n\ndef slow_reward(prompts, completions, **kw):\n"
        "    time.sleep(120)\n    return [0.0] * len(completions)\n")
NAN = "def nan_reward(prompts, completions, **kw):\n    return [1.0] + [float('nan')] * (len(completions) - 1)\n"


@pytest.fixture(scope="module")
def local_engine(tokenizer_dir):
    from periodic_async.config import ModelConfig
    from periodic_async.engine.local import LocalEngine
    from periodic_async.model import load_policy

    policy, tok = load_policy(ModelConfig(name_or_path="qwen2-micro", tokenizer=str(tokenizer_dir)))
    return LocalEngine(policy, tok, max_num_seqs=4), tok


def _first_iteration(local_engine, tmp_path, source: str, spec: str, timeout_s: float):
    """Generate and score iteration 0 (2 prompts x 2 samples) with the reward `spec` defined by
    `source`, through `make_reward` and the `Producer` as a run does; returns the error raised."""
    from periodic_async.config import RunConfig, load_config
    from periodic_async.data import load_examples
    from periodic_async.producer import Producer
    from periodic_async.reward import RewardError, make_reward

    path = tmp_path / f"{spec}.py"
    path.write_text(source)
    cfg = load_config(RunConfig, None, [f"reward.functions={path}:{spec}", f"reward.timeout_s={timeout_s}",
                                        "data.num_train=8", "data.num_eval=0", "engine.max_tokens=3",
                                        "algorithm.group_size=2", "algorithm.prompts_per_iteration=2"])
    engine, tok = local_engine
    producer = Producer(engine, tok, load_examples(cfg.data), [], make_reward(cfg.reward), cfg)
    producer.start(0)
    with pytest.raises(RewardError) as err:
        for _ in producer.stream(poll_s=0.2):
            pass
    producer.close()
    return str(err.value)


def _children_running(name: str) -> list:
    import psutil

    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and name in " ".join(p.cmdline())]


def test_reward_timeout(local_engine, tmp_path):
    """A user reward that hangs stops the run within about reward.timeout_s (not the 120 s it
    sleeps) with a RewardError naming the function, the group and the timeout; its worker
    process is killed."""
    import re
    import time

    from periodic_async.config import DataConfig
    from periodic_async.data import iteration_prompts, load_examples

    t0 = time.time()
    msg = _first_iteration(local_engine, tmp_path, SLOW, "slow_reward", timeout_s=2.0)
    assert time.time() - t0 < 100, msg  # not the 120 s the reward sleeps
    assert "slow_reward" in msg and "timed out" in msg and "after 2 s (reward.timeout_s)" in msg, msg
    m = re.match(r"iteration 0, prompt (\d+) ", msg)
    batch = iteration_prompts(load_examples(DataConfig(num_train=8, num_eval=0)), 0, 2, 0)
    assert m and int(m.group(1)) in {i for i, _ in batch}, msg
    assert _children_running("slow_reward") == []


def test_nan_reward_names_the_group(local_engine, tmp_path):
    """A NaN from a user reward (run in its worker process, through the producer) stops the run
    with a RewardError naming the function, the iteration, the prompt and the value."""
    import re

    msg = _first_iteration(local_engine, tmp_path, NAN, "nan_reward", timeout_s=60.0)
    assert re.match(r"iteration 0, prompt \d+ \(request it0-p\d+-\d\): RewardError: ", msg), msg
    assert "nan_reward" in msg and "returned non-finite reward(s) nan (completion 1)" in msg, msg


def test_reward_worker_imports_only_what_is_named(tmp_path, monkeypatch):
    """Reward code comes only from the module or file named: a module of the same name in the
    working directory is not what the worker process imports (it uses the caller's sys.path,
    without `python -c`'s implicit working directory)."""
    import sys

    from periodic_async.reward import combined_reward

    (tmp_path / "periodic_async").mkdir()
    (tmp_path / "periodic_async" / "__init__.py").write_text("raise SystemExit('imported from the cwd')\n")
    spec_file = tmp_path / "named.py"
    spec_file.write_text("def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    assert "" not in sys.path and str(tmp_path) not in sys.path
    reward = combined_reward([f"{spec_file}:one"], [1.0], timeout_s=60)
    assert reward(["p"], ["a", "b"], answer=["1", "1"]) == [1.0, 1.0]
    reward.close()


COLUMNS = '''
def level_reward(prompts, completions, level, answer, unit, **kw):
    assert all(a.isdigit() for a in answer), answer  # the parsed ground truth, not the solution text
    assert all(p.endswith(u + "?") or u in p for p, u in zip(prompts, unit)), (prompts, unit)
    return [float(x) for x in level]

def level_accuracy(prompts, completions, level, **kw):
    return [x / 10 for x in level]

def too_big(prompts, completions, **kw):
    return [2.0] * len(completions)
'''


def test_reward_and_accuracy_functions_get_every_column(local_engine, tmp_path):
    """Through the producer, as a run scores: user reward and accuracy functions (in their worker
    process) receive every dataset column per completion (TRL's convention) with `answer` parsed;
    the group's `correct` and the held-out accuracy come from `reward.accuracy_function`."""
    import json

    from periodic_async.config import RunConfig, load_config
    from periodic_async.data import load_examples
    from periodic_async.producer import Producer
    from periodic_async.reward import make_reward

    data = tmp_path / "d.jsonl"
    rows = [{"question": f"How many {u}?", "answer": f"{i} + 1\n#### {i + 1}", "level": i, "unit": u}
            for i, u in enumerate(["apples", "pens", "cards", "coins", "books", "cups"])]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "cols.py").write_text(COLUMNS)
    cfg = load_config(RunConfig, None, [f"data.source={data}", "data.num_train=4", "data.num_eval=2",
                                        f"reward.functions={tmp_path / 'cols.py'}:level_reward",
                                        f"reward.accuracy_function={tmp_path / 'cols.py'}:level_accuracy",
                                        "engine.max_tokens=3", "algorithm.group_size=2",
                                        "algorithm.prompts_per_iteration=2"])
    engine, tok = local_engine
    producer = Producer(engine, tok, load_examples(cfg.data), [], make_reward(cfg.reward), cfg,
                        eval_examples=load_examples(cfg.data, "eval"))
    try:
        producer.start(0)
        groups = list(producer.stream(poll_s=0.2))
        assert len(groups) == 2
        for g in groups:
            level = rows[g.prompt_index]["level"]
            assert g.rewards == [float(level)] * 2 and g.correct == [level / 10] * 2
        ev = producer.evaluate_now(1)
        assert ev["correct"] == [0.4, 0.5] and abs(ev["accuracy"] - 0.45) < 1e-12
        assert abs(ev["stderr"] - 0.05 / 2**0.5) < 1e-12
    finally:
        producer.close()
        producer.accuracy_fn.close()


def test_accuracy_outside_unit_interval_is_an_error(tmp_path):
    from periodic_async.config import RewardConfig
    from periodic_async.reward import RewardError, make_accuracy

    (tmp_path / "cols.py").write_text(COLUMNS)
    acc = make_accuracy(RewardConfig(accuracy_function=f"{tmp_path / 'cols.py'}:too_big", timeout_s=0))
    with pytest.raises(RewardError, match=r"accuracy function .*too_big' \(reward.accuracy_function\) returned "
                                          r"2.0 \(completion 0\).*expected scores in \[0, 1\]"):
        acc(["p"], ["a"], answer=["1"])
    default = make_accuracy(RewardConfig())
    assert default(["p", "p"], ["#### 3", "#### 4"], answer=["3", "3"], level=[1, 2]) == [1.0, 0.0]


# --- the reward worker process: restarts, its own protocol channel, its CPUs -------------------

DIES_ONCE = '''import os
from pathlib import Path

def dies_once(prompts, completions, marker, **kw):
    if not Path(marker[0]).exists():  # the first call only: the worker process dies mid-call
        Path(marker[0]).write_text("died")
        os._exit(3)
    return [1.0] * len(completions)

def always_dies(prompts, completions, marker, **kw):
    with open(marker[0], "a") as f:
        f.write("try\\n")
    os._exit(3)

def my_pid(prompts, completions, **kw):
    return [float(os.getpid())] * len(completions)

def echoes(prompts, completions, **kw):
    os.system("echo 0.5")  # fd 1 of the worker: must not reach the protocol
    print("[7.0]")
    return [float(len(c)) for c in completions]

def stray_reply(prompts, completions, marker, kind, **kw):
    """Once: writes a line onto the worker's reply channel itself (a reply to another call, or
    an unreadable one), as corrupting code could; the parent must not take it as this call's."""
    if not Path(marker[0]).exists():
        Path(marker[0]).write_text("done")
        from periodic_async.reward import worker
        worker._reply.write('{"id": -1, "result": [9.0]}\\n' if kind[0] == "id" else "0.5\\n")
        worker._reply.flush()
    return [float(len(c)) for c in completions]
'''


def _user_reward(tmp_path, name: str):
    path = tmp_path / "user_rewards.py"
    path.write_text(DIES_ONCE)
    return combined_reward([f"{path}:{name}"], [1.0], timeout_s=60)


def test_reward_worker_that_dies_once_is_restarted(tmp_path):
    """A user reward that kills its own worker process (os._exit) on its first call: the call is
    sent again to a new worker, which answers; the restart is counted in the run's metrics."""
    from periodic_async.reward import reward_stats

    reward = _user_reward(tmp_path, "dies_once")
    before = reward_stats()["reward/worker_restarts"]
    marker = str(tmp_path / "died")
    try:
        assert reward(["p"] * 2, ["a", "b"], marker=[marker] * 2) == [1.0, 1.0]
        assert reward(["p"], ["a"], marker=[marker]) == [1.0]
    finally:
        reward.close()
    assert (tmp_path / "died").read_text() == "died"
    assert reward_stats()["reward/worker_restarts"] - before == 1


def test_reward_worker_that_keeps_dying_stops_the_run(tmp_path):
    """A user reward whose worker dies on every call: tried MAX_DEATHS (3) times in a row, then
    one line naming the function and the exit code."""
    from periodic_async.reward import RewardError
    from periodic_async.reward.worker import MAX_DEATHS

    reward = _user_reward(tmp_path, "always_dies")
    tries = tmp_path / "tries"
    try:
        with pytest.raises(RewardError) as err:
            reward(["p"], ["a"], marker=[str(tries)])
    finally:
        reward.close()
    msg = str(err.value)
    assert MAX_DEATHS == 3 and tries.read_text().count("try") == MAX_DEATHS
    assert "\n" not in msg and "always_dies" in msg, msg
    assert "died 3 times in a row" in msg and "exit code 3" in msg, msg


def test_reward_worker_killed_between_calls_is_replaced(tmp_path):
    """The user reward's worker killed from outside between calls: the next call gets a new one."""
    import os
    import signal

    from periodic_async.reward import reward_stats

    reward = _user_reward(tmp_path, "my_pid")
    try:
        pid = int(reward(["p"], ["a"])[0])
        before = reward_stats()["reward/worker_restarts"]
        os.kill(pid, signal.SIGKILL)
        new = int(reward(["p"], ["a"])[0])
    finally:
        reward.close()
    assert new != pid and reward_stats()["reward/worker_restarts"] - before == 1


def test_bounded_worker_killed_between_calls_is_replaced():
    """The same for the worker itself, whether its death is seen before the request is written
    (reaped) or only when writing it (a broken pipe): the next call works."""
    import os
    import signal
    import time

    from periodic_async.reward import TimedWorker

    worker = TimedWorker()
    try:
        for wait_s in (0.0, 0.5):
            pid = worker.call("os:getpid", timeout_s=60)
            os.kill(pid, signal.SIGKILL)
            time.sleep(wait_s)
            assert worker.call("operator:add", 2, 3, timeout_s=60) == 5
            assert worker.pid != pid
    finally:
        worker.close()


def test_math_verify_worker_killed_between_calls_is_replaced():
    """math-verify's worker killed from outside: the next comparison still runs (before, every
    later call raised BrokenPipeError and the run died)."""
    pytest.importorskip("math_verify")
    import os
    import signal

    from periodic_async.reward import answers, math_verify_stats, reward_stats
    from periodic_async.reward.answers import math_verify_equal

    assert math_verify_equal("\\boxed{\\frac{1}{2}}", "0.5")
    before, restarts = math_verify_stats(), reward_stats()["reward/worker_restarts"]
    os.kill(answers._math_worker.pid, signal.SIGKILL)
    assert math_verify_equal("\\boxed{\\frac{1}{2}}", "0.5")
    after = math_verify_stats()
    assert after["errors"] == before["errors"] and after["equal"] - before["equal"] == 1
    assert reward_stats()["reward/worker_restarts"] - restarts == 1


def test_reward_output_on_fd1_goes_to_stderr(tmp_path, capfd):
    """Reward code that writes to file descriptor 1 (os.system, C code, print) cannot corrupt the
    worker's replies: each call returns its own rewards, the text goes to stderr."""
    reward = _user_reward(tmp_path, "echoes")
    try:
        got = [reward(["p"] * len(c), c) for c in (["a"], ["ab", "abc"], ["abcd"], ["abcde"])]
    finally:
        reward.close()
    assert got == [[1.0], [2.0, 3.0], [4.0], [5.0]]
    err = capfd.readouterr().err
    assert err.count("0.5") == 4 and err.count("[7.0]") == 4, err


@pytest.mark.parametrize("kind", ["id", "garbage"])
def test_reply_to_another_call_is_never_taken(tmp_path, kind):
    """A line on the reply channel that is not this call's reply (another call id, or not JSON)
    kills the worker and the call is sent again: never a shifted or foreign reward."""
    from periodic_async.reward import reward_stats

    reward = _user_reward(tmp_path, "stray_reply")
    before = reward_stats()["reward/worker_restarts"]
    marker = str(tmp_path / "stray")
    try:
        assert reward(["p"], ["ab"], marker=[marker], kind=[kind]) == [2.0]
        assert reward(["p"], ["abc"], marker=[marker], kind=[kind]) == [3.0]
    finally:
        reward.close()
    assert reward_stats()["reward/worker_restarts"] - before == 1


def test_bounded_worker_cpus_hold_across_restarts():
    """A worker started with cpus=[0] runs on CPU 0 only, and so does its replacement."""
    import os
    import signal

    from periodic_async.reward import TimedWorker

    worker = TimedWorker(cpus=[0])
    try:
        assert worker.call("periodic_async.reward.worker:cpu_affinity", timeout_s=60) == [0]
        os.kill(worker.pid, signal.SIGKILL)
        assert worker.call("periodic_async.reward.worker:cpu_affinity", timeout_s=60) == [0]
    finally:
        worker.close()
    with pytest.raises(ValueError, match=r"cpus=\[\]: expected a non-empty list of CPU ids"):
        TimedWorker(cpus=[])


def test_default_worker_cpus_apply_to_later_workers():
    """`set_worker_cpus` (the run's reward cores) pins workers created without `cpus` at every
    start; None restores the default (the caller's CPUs)."""
    import os

    from periodic_async.reward import TimedWorker, set_worker_cpus

    worker = TimedWorker()
    cpu = max(os.sched_getaffinity(0))
    set_worker_cpus([cpu])
    try:
        assert worker.call("periodic_async.reward.worker:cpu_affinity", timeout_s=60) == [cpu]
    finally:
        set_worker_cpus(None)
        worker.close()
    assert worker.call("periodic_async.reward.worker:cpu_affinity", timeout_s=60) == sorted(os.sched_getaffinity(0))
    worker.close()


def test_math_verify_worker_that_keeps_dying_stops_the_run(monkeypatch):
    """math-verify's worker dying on every comparison (here its verify_math exits the process):
    after MAX_DEATHS tries the run stops with one line, not scores of 0 for ever."""
    pytest.importorskip("math_verify")
    from periodic_async.reward import TimedWorker, RewardError, answers, math_reward

    dying = TimedWorker(warmup=[("builtins:exec", ["import os, periodic_async.reward.answers as a; "
                                                     "a.verify_math = lambda *args: os._exit(5)"])])
    monkeypatch.setattr(answers, "_math_worker", dying)
    try:
        with pytest.raises(RewardError) as err:
            math_reward(None, ["\\boxed{\\frac{1}{2}}"], answer=["0.5"])
    finally:
        dying.close()
    msg = str(err.value)
    assert "\n" not in msg and "exit code 5" in msg, msg
    assert msg.startswith("math-verify: worker process died 3 times in a row"), msg
