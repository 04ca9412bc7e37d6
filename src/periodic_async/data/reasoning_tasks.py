"""Task sources: reasoning-gym's procedural tasks as training data, held-out set and reward.

`data.source: reasoning-gym:NAME` (any task in `reasoning_gym.factory.DATASETS`, `composite`
included) with `data.task_config`, the keyword arguments of `reasoning_gym.create_dataset`:

    training   create_dataset(NAME, seed=data.seed, size=data.num_train, **task_config), entry i
    held-out   create_dataset(NAME, seed=data.seed + 1, size=2 * (data.num_train + data.num_eval),
               **task_config): its first data.num_eval entries whose question is not a training
               question (how many were skipped is logged). Many tasks seed entry i with seed + i,
               so seed + 1 repeats the training entries shifted by one: the skip is what keeps the
               held-out set the size asked for.

Both are a pure function of the config. Each entry becomes an `Example` whose columns (the
reward functions' keyword arguments) name where it came from: `source_dataset` and
`source_index` (the entry's metadata: the sub-task of a composite), and `task_spec` (the
create_dataset call, as JSON) with `task_index` (the entry's index in it). The reward
(`reward/tasks.py`) rebuilds the entry from these two in the reward worker and scores it with the
task's own `score_answer`: nothing about an entry has to survive a trip through JSON.
The prompt is the entry's question as the user turn under reasoning-gym's
`SYSTEM_PROMPTS["default"]` (unless data.system_prompt is set); the supervised warm start's
target is the entry's worked solution (`metadata["answer_cot"]`) where it has one, then the
answer in the tags that system prompt asks for.

Bad input is one line (a `DataError`): an unknown task names the closest names, an unknown
task_config key the task's fields, a missing package the install command, and a configuration
reasoning-gym refuses its message, prefixed with the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json

from periodic_async.config import DataConfig
from periodic_async.data.tasks import DataError, Example

PREFIX = "reasoning-gym:"
INSTALL = "pip install 'periodic-async[tasks]' (or: pip install reasoning-gym==0.1.25)"


def task_name(source: str) -> str | None:
    """NAME of a 'reasoning-gym:NAME' source; None for any other source."""
    return source[len(PREFIX):].strip() if source.startswith(PREFIX) else None


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(f"a reasoning-gym task source needs the reasoning-gym package: {INSTALL}") from None
    return reasoning_gym


def system_prompt() -> str:
    """reasoning-gym's default system prompt (answer inside <answer>...</answer>)."""
    _rg()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def spec(name: str, task_config: dict, seed: int, size: int) -> str:
    """The create_dataset call as canonical JSON: what `dataset` rebuilds (the `task_spec` column)."""
    return json.dumps({"name": name, "config": task_config, "seed": seed, "size": size}, sort_keys=True)


def create(name: str, task_config: dict, seed: int, size: int, where: str = "data"):
    """`reasoning_gym.create_dataset(name, seed=, size=, **task_config)`, its refusals as one-line
    DataErrors naming `where`.source / `where`.task_config."""
    rg = _rg()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, sorted(DATASETS), n=4, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "its tasks: reasoning_gym.factory.DATASETS"
        raise DataError(f"{where}.source={PREFIX + name!r}: reasoning-gym has no task {name!r}; {hint}")
    fields = [f.name for f in dataclasses.fields(DATASETS[name][1])]
    taken = sorted({"seed", "size"} & set(task_config))
    if taken:
        raise DataError(f"{where}.task_config: {', '.join(taken)} come(s) from data.seed and data.num_train / "
                        "data.num_eval; remove them from task_config")
    unknown = sorted(set(task_config) - set(fields))
    if unknown:
        known = ", ".join(f for f in fields if f not in ("seed", "size"))
        raise DataError(f"{where}.task_config: {name!r} has no field(s) {', '.join(unknown)}; its fields: {known}")
    kwargs = dict(task_config)
    if name == "composite":
        kwargs["datasets"] = _composite_specs(kwargs.get("datasets"), where)
    try:
        return rg.create_dataset(name, seed=seed, size=size, **kwargs)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - reasoning-gym refuses with AssertionError, ValueError, TypeError
        raise DataError(f"{where}.task_config={task_config!r}: reasoning-gym refused it: "
                        f"{str(e) or type(e).__name__}") from None


def _composite_specs(datasets, where: str) -> list:
    """composite's `datasets` (mappings {name, weight, config}, as YAML gives them) as its
    DatasetSpec objects, each sub-task's name and config checked like a task's."""
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.factory import DATASETS

    if not isinstance(datasets, list) or not datasets:
        raise DataError(f"{where}.task_config: composite needs datasets: a list of {{name, weight, config}}")
    specs = []
    for d in datasets:
        if isinstance(d, DatasetSpec):
            specs.append(d)
            continue
        if not isinstance(d, dict) or "name" not in d or set(d) - {"name", "weight", "config"}:
            raise DataError(f"{where}.task_config: composite dataset {d!r}: expected {{name, weight, config}}")
        config = dict(d.get("config") or {})
        name = d["name"]
        if name not in DATASETS or name == "composite":
            close = difflib.get_close_matches(str(name), sorted(DATASETS), n=4, cutoff=0.5)
            raise DataError(f"{where}.task_config: composite dataset {name!r} is not a reasoning-gym task"
                            f"{'; did you mean ' + ', '.join(close) + '?' if close else ''}")
        fields = {f.name for f in dataclasses.fields(DATASETS[name][1])}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise DataError(f"{where}.task_config: composite dataset {name!r} has no field(s) {', '.join(unknown)}; "
                            f"its fields: {', '.join(sorted(fields - {'seed', 'size'}))}")
        specs.append(DatasetSpec(name=name, weight=float(d.get("weight", 1.0)), config=config))
    return specs


@functools.lru_cache(maxsize=8)
def dataset(task_spec: str):
    """The dataset of a `spec` (cached: the reward worker rebuilds each one once)."""
    s = json.loads(task_spec)
    return create(s["name"], s["config"], s["seed"], s["size"])


@functools.lru_cache(maxsize=4096)
def _entry(task_spec: str, index: int) -> dict:
    return dataset(task_spec)[index]


def entry(task_spec: str, index: int) -> dict:
    """Entry `index` of the dataset of `task_spec` (cached: the G completions of a group share it)."""
    return _entry(task_spec, int(index))


def target(entry: dict) -> str:
    """The warm start's target: the worked solution (metadata['answer_cot']) where there is one, then
    the answer in the tags of reasoning-gym's system prompt."""
    cot = (entry.get("metadata") or {}).get("answer_cot")
    tagged = f"<answer>{entry['answer']}</answer>"
    return f"{str(cot).rstrip()}\n{tagged}" if cot else tagged


def to_example(entry: dict, task_spec: str, index: int) -> Example:
    """One entry as an Example whose columns name its source (see the module docstring)."""
    meta = entry.get("metadata") or {}
    source, source_index = meta.get("source_dataset", json.loads(task_spec)["name"]), meta.get("source_index", index)
    columns = {"question": entry["question"], "answer": str(entry["answer"]), "source_dataset": source,
               "source_index": source_index, "task_spec": task_spec, "task_index": index}
    return Example(entry["question"], str(entry["answer"]), target(entry), f"{source}-{source_index}", columns=columns)


def task_examples(cfg: DataConfig, split: str, source: str | None = None) -> list[Example]:
    """The training ('train') or held-out ('eval') examples of the task source `source` (default
    cfg.source); see the module docstring."""
    name = task_name(source or cfg.source)
    train_spec = spec(name, cfg.task_config, cfg.seed, cfg.num_train)
    train = [to_example(e, train_spec, i) for i, e in enumerate(_entries(train_spec, cfg.num_train))]
    if split == "train":
        if not train:
            raise DataError(f"data.source={cfg.source!r}: data.num_train=0 (a task source needs a size)")
        return train
    seen = {" ".join(e.question.split()) for e in train}
    size = 2 * (cfg.num_train + cfg.num_eval)  # room for the shifted repeats and for chance collisions
    eval_spec = spec(name, cfg.task_config, cfg.seed + 1, size)
    ds, out, skipped = dataset(eval_spec), [], 0
    for i in range(size):
        e = ds[i]
        if " ".join(e["question"].split()) in seen:
            skipped += 1
            continue
        out.append(to_example(e, eval_spec, i))
        if len(out) == cfg.num_eval:
            break
    msg = (f"[data] {PREFIX}{name}: held-out set of {len(out)} entries (seed {cfg.seed + 1}); skipped {skipped} "
           "whose question is also a training question")
    print(msg)
    if len(out) < cfg.num_eval:
        raise DataError(f"data.source={cfg.source!r}: only {len(out)} of data.num_eval={cfg.num_eval} held-out "
                        f"questions differ from the {cfg.num_train} training questions; the task has too few distinct "
                        "questions: widen data.task_config or lower data.num_train / data.num_eval")
    return out


def _entries(task_spec: str, n: int) -> list[dict]:
    return [_entry(task_spec, i) for i in range(n)]  # cached: the reward scoring them in this process reuses them
