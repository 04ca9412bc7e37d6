"""Config: YAML + overrides, type conversion, and validation errors that name field and value."""

import os
import time
from pathlib import Path

import pytest
import yaml

from periodic_async.config import ConfigError, RunConfig, SFTRunConfig, load_config
from periodic_async.records import save_run_info


def test_defaults_and_overrides():
    cfg = load_config(RunConfig, None, ["algorithm.lr=3e-5", "engine.num_workers=2", "algorithm.shared_prompt=false",
                                        "reward.functions=a:b,c:d", "reward.weights=[1.0, 0.5]"])
    assert cfg.algorithm.lr == 3e-5 and cfg.engine.num_workers == 2 and cfg.algorithm.shared_prompt is False
    assert cfg.reward.functions == ["a:b", "c:d"] and cfg.reward.weights == [1.0, 0.5]


def test_ray_address_from_the_environment(monkeypatch):
    """engine.ray_address empty: RAY_ADDRESS (a `ray job submit` entrypoint's, the smoke run's);
    given: it wins. Only a loopback address is this machine."""
    from periodic_async.config import EngineConfig

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert EngineConfig().ray_address == "" and EngineConfig().ray_on_this_machine
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert load_config(RunConfig, None, []).engine.ray_address == "127.0.0.1:6379"
    assert EngineConfig().ray_on_this_machine and EngineConfig(ray_address="localhost:1").ray_on_this_machine
    cluster = load_config(RunConfig, None, ["engine.ray_address=10.0.0.1:6379"]).engine
    assert cluster.ray_address == "10.0.0.1:6379" and not cluster.ray_on_this_machine
    assert not EngineConfig(ray_address="ray://127.0.0.1:10001").ray_on_this_machine  # Ray Client: a remote driver


def test_cpu_name_names_the_vector_unit_and_cores():
    """What every measured row records of the machine: the vector unit /proc/cpuinfo's flags
    name, and the cores this process may use; no comma (a CSV field)."""
    from periodic_async.records import cpu_name

    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    full, short = cpu_name(), cpu_name(cores=False)
    assert full.endswith(f"({isa}; {len(os.sched_getaffinity(0))} cores)") and short.endswith(f"({isa})")
    assert full.split(" (")[0] == short.split(" (")[0] and "," not in full


def test_yaml_file_then_override(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"trainer": {"iterations": 3}, "pipeline": {"mode": "sync-separated"}}))
    cfg = load_config(RunConfig, p, ["trainer.iterations=5"])
    assert cfg.trainer.iterations == 5 and cfg.pipeline.mode == "sync-separated"


@pytest.mark.parametrize("override,fragment", [
    ("pipeline.mode=async", "pipeline.mode='async'"),
    ("algorithm.group_size=0", "algorithm.group_size=0"),
    ("algorithm.group_size=1", "every advantage is 0"),
    ("algorithm.loss_norm=mean", "algorithm.loss_norm='mean'"),
    ("engine.top_p=0", "engine.top_p=0"),
    ("model.dtype=int8", "model.dtype='int8'"),
    ("data.min_steps=5", "data.min_steps=5"),
    ("reward.weights=[1.0, 2.0]", "reward.weights"),
    ("engine.num_workers=two", "engine.num_workers='two'"),
    ("algorithm.shared_prompt=maybe", "algorithm.shared_prompt='maybe'"),
])
def test_validation_errors_name_field_and_value(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, None, [override])
    assert fragment in str(e.value)


def test_unknown_keys_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(RunConfig, None, ["algorithm.learning_rate=1"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RunConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(SFTRunConfig, None, ["sft.lr"])


def test_yaml_errors_name_the_file_and_line(tmp_path):
    """A YAML syntax error and a byte that is not UTF-8 are ConfigErrors naming file:line."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  iterations: 3\nalgorithm:\n  lr: [1e-4, 2e-4\n")  # the list never closes
    with pytest.raises(ConfigError, match=rf"config file {bad}:5: YAML syntax error: while parsing a flow sequence"):
        load_config(RunConfig, bad)
    bad.write_bytes(b"trainer:\n  iterations: 3\n  output_dir: runs/caf\xe9\n")  # latin-1
    with pytest.raises(ConfigError, match=rf"config file {bad}:3: not UTF-8 text"):
        load_config(RunConfig, bad)


def test_save_run_info_round_trips(tmp_path):
    cfg = load_config(RunConfig, None, ["trainer.iterations=7"])
    out = save_run_info(cfg, tmp_path / "run")
    again = load_config(RunConfig, out / "config.yaml")
    assert again == cfg
    assert "git_commit" in (out / "run_info.json").read_text()


def test_saved_run_info_has_no_secrets(tmp_path, monkeypatch):
    """Secret environment values (WANDB_API_KEY, HF_TOKEN, *SECRET*, *PASSWORD*) never reach
    config.yaml or run_info.json, even pasted into a config value; other values are kept."""
    secrets = {"WANDB_API_KEY": "wandb-0123456789abcdef", "HF_TOKEN": "hf_TopSecretToken42",
               "MY_DB_PASSWORD": "correct-horse-battery", "SOME_SECRET": "s3cr3t-value-99"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a short value is not a secret: kept
    cfg = load_config(RunConfig, None, [f"engine.ray_address=ray://me:{secrets['MY_DB_PASSWORD']}@head:10001",
                                        f"logging.wandb_project={secrets['HF_TOKEN']}-proj",
                                        f"trainer.output_dir={tmp_path / 'run'}"])
    out = save_run_info(cfg, tmp_path / "run")
    text = "".join(p.read_text() for p in sorted(out.iterdir()))
    for v in secrets.values():
        assert v not in text
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["engine"]["ray_address"] == "ray://me:<redacted>@head:10001"
    assert saved["logging"]["wandb_project"] == "<redacted>-proj"
    assert saved["engine"]["max_tokens"] == cfg.engine.max_tokens and saved["pipeline"]["mode"] == "periodic-async"


def test_wandb_never_sees_a_secret_on_the_command_line(tmp_path, monkeypatch):
    """W&B records the command line with each run: a secret passed as an override reaches
    neither its config nor its metadata (offline run files), nor changes our own sys.argv."""
    import sys

    pytest.importorskip("wandb")
    from periodic_async.trace import MetricsLogger

    token = "hf_CommandLineToken77"
    monkeypatch.setenv("HF_TOKEN", token)
    for var in ("WANDB_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    argv = ["periodic-async", "train", f"engine.ray_address=ray://me:{token}@head:10001"]
    monkeypatch.setattr(sys, "argv", argv)
    cfg = load_config(RunConfig, None, argv[2:] + [f"trainer.output_dir={tmp_path}"])
    logger = MetricsLogger(tmp_path, cfg, mode="offline")
    logger.log({"x": 1.0}, step=1)
    logger.close()
    assert sys.argv is argv
    # W&B's service process writes the offline record on its own schedule: wait for it to be done
    # (teardown stops the service, which flushes), then for the record of the command line itself.
    import wandb

    wandb.teardown()
    redacted, deadline = b"engine.ray_address=ray://me:<redacted>@head", time.time() + 120
    while not any(redacted in p.read_bytes() for p in tmp_path.rglob("*.wandb")):
        assert time.time() < deadline, "W&B wrote no record of the command line within 120 s"
        time.sleep(0.2)
    for p in (p for p in tmp_path.rglob("*") if p.is_file()):
        assert token.encode() not in p.read_bytes(), p


HERMETIC = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "RAY_ADDRESS": None}
"""What the suite runs under whatever the shell says (tests/conftest.py): offline, W&B offline, Ray of its own."""


def test_suite_environment_is_hermetic():
    """The suite never reaches the hub or W&B online, nor joins a Ray cluster the shell points at."""
    import os

    assert {k: os.environ.get(k) for k in HERMETIC} == HERMETIC


def test_suite_environment_is_hermetic_under_a_hostile_shell():
    """The same check in a pytest started from a shell that says online W&B, online hub and another
    Ray cluster (RAY_ADDRESS=auto): conftest overrides them, so tests cannot join or upload."""
    import os
    import subprocess
    import sys

    env = {**{k: v for k, v in os.environ.items() if k != "PA_TEST_COSTS"},  # not recorded as the suite's
           "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "WANDB_MODE": "online", "RAY_ADDRESS": "auto"}
    here = Path(__file__).resolve()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        f"{here}::test_suite_environment_is_hermetic"], env=env, cwd=here.parent.parent,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
