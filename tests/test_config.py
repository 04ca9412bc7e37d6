"""Config: YAML + overrides, type conversion, and validation errors that name field and value."""

import pytest
import yaml

from periodic_async.config import ConfigError, RunConfig, SFTRunConfig, load_config, save_run_info


def test_defaults_and_overrides():
    cfg = load_config(RunConfig, None, ["algorithm.lr=3e-5", "engine.num_workers=2", "algorithm.shared_prompt=false",
                                        "reward.functions=a:b,c:d", "reward.weights=[1.0, 0.5]"])
    assert cfg.algorithm.lr == 3e-5 and cfg.engine.num_workers == 2 and cfg.algorithm.shared_prompt is False
    assert cfg.reward.functions == ["a:b", "c:d"] and cfg.reward.weights == [1.0, 0.5]


def test_yaml_file_then_override(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"trainer": {"iterations": 3}, "pipeline": {"mode": "sync-separated"}}))
    cfg = load_config(RunConfig, p, ["trainer.iterations=5"])
    assert cfg.trainer.iterations == 5 and cfg.pipeline.mode == "sync-separated"


@pytest.mark.parametrize("override,fragment", [
    ("pipeline.mode=async", "pipeline.mode='async'"),
    ("algorithm.group_size=0", "algorithm.group_size=0"),
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


def test_save_run_info_round_trips(tmp_path):
    cfg = load_config(RunConfig, None, ["trainer.iterations=7"])
    out = save_run_info(cfg, tmp_path / "run")
    again = load_config(RunConfig, out / "config.yaml")
    assert again == cfg
    assert "git_commit" in (out / "run_info.json").read_text()
