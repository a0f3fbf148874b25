"""The run-config parser: defaults match pyproject, and bad input names the key."""
import tomllib

import pytest

from flower_apps.config import AppConfig, parse_run_config
from strategies.registry import algorithm_names, get_algorithm
from tasks.config import ConfigError, TaskConfig, to_flat
from tests.flower_harness import ROOT


def pyproject_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        cfg = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    flat = {}

    def walk(prefix, d):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                walk(key, v)
            else:
                flat[key] = v
    walk("", cfg)
    return flat


def test_pyproject_defaults_equal_dataclass_defaults():
    flat = pyproject_config()
    expected = {**to_flat(AppConfig()), **to_flat(TaskConfig())}
    for name in algorithm_names():
        spec = get_algorithm(name)
        if spec.config_cls is not None:
            expected.update(to_flat(spec.config_cls(), spec.namespace))
    assert set(flat) == set(expected), set(flat) ^ set(expected)
    assert {k: flat[k] for k in flat if flat[k] != expected[k]} == {}


def test_defaults_parse():
    parsed = parse_run_config(pyproject_config())
    assert parsed.spec.name == parsed.app.algo


@pytest.mark.parametrize("override, needle", [
    ({"algo": "fedavgg"}, "algo='fedavgg' is not one of"),
    ({"num-rounds": 0}, "num-rounds=0 is out of range"),
    ({"num-rounds": "ten"}, "num-rounds='ten' must be an integer"),
    ({"num-rounds": 2.5}, "num-rounds=2.5 must be an integer"),
    ({"lr": "fast"}, "lr='fast' must be a number"),
    ({"lr": 0.0}, "lr=0.0 is out of range"),
    ({"fraction-train": 1.5}, "fraction-train=1.5 is out of range"),
    ({"model": "resnet50"}, "model='resnet50' is not one of"),
    ({"norm": "ln"}, "norm='ln' is not one of: bn, gn, none"),
    ({"partition": "pathological"}, "partition='pathological' is not one of"),
    ({"partition-r": 1.2}, "partition-r=1.2 is out of range"),
    ({"dropout": 1.0}, "dropout=1.0 is out of range"),
    ({"resume": "yes"}, "resume='yes' must be a boolean"),
    ({"resume": True}, "resume=true needs run-name"),
    ({"batch-sise": 3}, "unknown run-config key 'batch-sise' (did you mean batch-size?)"),
    ({"nosuch.key": 3}, "unknown run-config namespace in 'nosuch.key'"),
    ({"device": "tpu"}, "device='tpu' is not one of"),
    ({"local-epochs": 0, "local-steps": 0}, "local-epochs and local-steps are both 0"),
])
def test_bad_values_name_the_key(override, needle):
    cfg = {**pyproject_config(), **override}
    with pytest.raises(ConfigError) as e:
        parse_run_config(cfg)
    assert needle in str(e.value)


def test_every_algorithm_resolves():
    for name in algorithm_names():
        spec = get_algorithm(name)
        assert spec.name == name
        parsed = parse_run_config({**pyproject_config(), "algo": name})
        assert parsed.spec is spec


def test_uv_overrides_cover_every_requirement():
    """[tool.uv] override-dependencies excludes every requirement for uv (so a SuperLink's
    per-run `uv sync` installs nothing), and only for uv: pip still installs them all."""
    import re
    with open(ROOT / "pyproject.toml", "rb") as fh:
        py = tomllib.load(fh)

    def name(req: str) -> str:
        return re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0].lower()

    reqs = py["project"]["dependencies"] + [r for extra in py["project"]["optional-dependencies"].values()
                                            for r in extra]
    overrides = py["tool"]["uv"]["override-dependencies"]
    assert sorted(map(name, overrides)) == sorted(map(name, reqs))
    assert all(o.split(";")[1].strip() == "python_version < '3'" for o in overrides)  # never true here
