import pytest
import yaml

from stages import config as cfg


def write(tmp_path, data):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def full(**changes):
    data = {name: {} for name in cfg.SECTIONS}
    for section, values in changes.items():
        data[section] = values
    return data


def test_defaults_load(tmp_path):
    configs = cfg.load_all(write(tmp_path, full()))
    assert configs["train"].lr == 1e-3
    assert configs["base"].environment == "arith"


def test_repo_params_are_valid():
    configs = cfg.load_all(cfg.Path(__file__).parents[1] / "params.yaml")
    assert set(configs) == set(cfg.SECTIONS)


def test_unknown_key_names_key_and_suggests(tmp_path):
    with pytest.raises(cfg.ParamsError) as err:
        cfg.load_all(write(tmp_path, full(train={"lrr": 0.1})))
    message = str(err.value)
    assert "params.yaml" in message and "train.lrr" in message and "train.lr" in message


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(cfg.ParamsError, match=r"rollout\.samples_per_task: expected a whole number"):
        cfg.load_all(write(tmp_path, full(rollout={"samples_per_task": "four"})))


def test_bool_is_not_an_int(tmp_path):
    with pytest.raises(cfg.ParamsError, match="rollout.samples_per_task"):
        cfg.load_all(write(tmp_path, full(rollout={"samples_per_task": True})))


def test_yaml_exponent_string_is_a_number(tmp_path):
    # PyYAML reads `1e-3` (no dot) as a string; a float field accepts it
    configs = cfg.load_all(write(tmp_path, full(train={"lr": "1e-3"})))
    assert configs["train"].lr == 0.001


def test_missing_section(tmp_path):
    data = full()
    del data["gate"]
    with pytest.raises(cfg.ParamsError, match="missing section 'gate:'"):
        cfg.load_all(write(tmp_path, data))


def test_unknown_section(tmp_path):
    with pytest.raises(cfg.ParamsError, match="unknown section 'trian'.*did you mean 'train'"):
        cfg.load_all(write(tmp_path, {**full(), "trian": {}}))


def test_cross_field_check(tmp_path):
    with pytest.raises(cfg.ParamsError, match=r"init.n_embd \(30\) must be divisible"):
        cfg.load_all(write(tmp_path, full(init={"n_embd": 30, "n_head": 4})))


def test_unknown_environment_lists_valid_ones(tmp_path):
    with pytest.raises(cfg.ParamsError, match=r"unknown environment 'chess'.*\['arith', 'code'\]"):
        cfg.load_all(write(tmp_path, full(base={"environment": "chess"})))


def test_range_check(tmp_path):
    with pytest.raises(cfg.ParamsError, match="validate.min_valid_fraction"):
        cfg.load_all(write(tmp_path, full(validate={"min_valid_fraction": 1.5})))
