"""The run-config parser: defaults match pyproject, and bad input names the key."""
import dataclasses
import tomllib

import pytest

from flower_apps.config import STREAM_FIELD, AppConfig, parse_run_config, pyproject_section, update_pyproject
from split_layer.stream_options import TLS_MODES, StreamOptions, stream_knobs
from split_layer.transport import TRANSPORT_CHOICES
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


def test_pyproject_run_config_is_generated_from_the_dataclasses():
    """pyproject's [tool.flwr.app.config] tables are exactly what `python -m flower_apps.config
    --pyproject` makes of the config dataclasses (keys declared once: there)."""
    assert update_pyproject(ROOT / "pyproject.toml", check=True), (
        "pyproject.toml's [tool.flwr.app.config] differs from the config dataclasses: regenerate it with "
        "`python -m flower_apps.config --pyproject`")
    assert (ROOT / "pyproject.toml").read_text().count(pyproject_section()) == 1


def test_pyproject_rewrite_changes_only_the_run_config_tables(tmp_path, capsys):
    """--pyproject rewrites a stale section in place and keeps every other table (one after it
    with its comment included); --check reports a stale section with exit 1 and writes nothing."""
    from flower_apps.config import main

    before = "[project]\nname = 'x'\n\n[tool.flwr.app.config]\nalgo = 'old'\n\n[tool.flwr.app.config.scala]\n" \
             "gone = 1\n\n# the plugins\n[project.entry-points.'flower_ssl.algorithms']\ntoy = 'toy'\n"
    path = tmp_path / "pyproject.toml"
    path.write_text(before)
    assert main(["--pyproject", str(path), "--check"]) == 1
    assert "differs from the config dataclasses" in capsys.readouterr().err
    assert path.read_text() == before
    assert main(["--pyproject", str(path)]) == 0
    assert path.read_text() == ("[project]\nname = 'x'\n\n" + pyproject_section()
                                + "\n# the plugins\n[project.entry-points.'flower_ssl.algorithms']\ntoy = 'toy'\n")
    assert main(["--pyproject", str(path), "--check"]) == 0
    with open(path, "rb") as fh:
        assert tomllib.load(fh)["project"]["entry-points"]["flower_ssl.algorithms"] == {"toy": "toy"}


def test_an_algorithm_sharing_anothers_keys_inherits_them():
    """SCALA-PE takes SCALA's keys by inheriting ScalaConfig (declared once); its namespace lists
    them (Flower needs every key) with SCALA's defaults."""
    from strategies.scala.scala import ScalaConfig
    from strategies.scala.scala_pe import ScalaPEConfig

    assert issubclass(ScalaPEConfig, ScalaConfig)
    own = {f.name for f in dataclasses.fields(ScalaPEConfig)} - {f.name for f in dataclasses.fields(ScalaConfig)}
    assert own and all(f.name in ScalaConfig.__dataclass_fields__ for f in dataclasses.fields(ScalaPEConfig)
                       if f.name not in own)
    flat = pyproject_config()
    for key, value in to_flat(ScalaConfig(), "scala").items():
        assert flat["scala-pe." + key.split(".", 1)[1]] == value == flat[key]


def test_the_model_list_is_tasks_models_MODELS():
    """One list of model families: the ``model`` key's values are MODELS' names, the ``norm`` key's
    are NORMS, and docs/config.md's models table has a row per family with the cut points and
    default cut of the model as built."""
    from flower_apps.config import models_markdown
    from tasks.models import MODELS, NORMS, build_model

    fields = {f.name: f for f in dataclasses.fields(TaskConfig)}
    assert fields["model"].metadata["choices"] == tuple(MODELS)
    assert fields["norm"].metadata["choices"] == NORMS
    table = models_markdown().splitlines()[2:]
    assert [line.split("`")[1] for line in table] == list(MODELS)
    cnn = build_model("cnn", in_channels=3, num_classes=10, image_size=32)
    assert table[0] == f"| `cnn` | {', '.join(cnn.cut_points)} | {cnn.default_cut} |"
    assert "| `vgg16` | conv1 .. conv13, fc1, fc2 | conv13 |" in table


def test_docs_config_md_is_generated():
    from flower_apps.config import main

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([]) == 0
    assert (ROOT / "docs" / "config.md").read_text() == buf.getvalue(), \
        "docs/config.md is stale: regenerate it with `python -m flower_apps.config > docs/config.md`"


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


def test_stream_options_are_stated_once():
    """Each split-stream-* key is a StreamOptions knob: AppConfig takes its default, allowed
    values and help (knob_of), pyproject lists it with that default, and the run config's
    options are exactly the StreamOptions the transport gets."""
    flat = pyproject_config()
    app_fields = {f.name: f for f in dataclasses.fields(AppConfig)}
    knobs = stream_knobs()
    assert {StreamOptions.key(f.name) for f, _ in knobs} == {k for k in flat if k.startswith("split-stream-")}
    for f, _ in knobs:
        mine = app_fields[STREAM_FIELD + f.name]
        assert (mine.default, dict(mine.metadata)) == (f.default, dict(f.metadata)), f.name
        assert flat[StreamOptions.key(f.name)] == f.default, f.name
    assert dict(app_fields["split_stream_tls"].metadata)["choices"] == TLS_MODES
    assert dict(app_fields["split_transport"].metadata)["choices"] == TRANSPORT_CHOICES
    cfg = {**flat, "split-stream-port": 7070, "split-stream-tls": "on", "split-stream-session": "round",
           "round-timeout": 42.0}
    assert parse_run_config(cfg).app.stream_options() == StreamOptions(port=7070, tls="on", session="round",
                                                                        timeout=42.0)


@pytest.mark.parametrize("override, needle", [
    ({"split-stream-port": 70000}, "split-stream-port=70000 is out of range; allowed [0, 65535]"),
    ({"split-stream-tls": "maybe"}, "split-stream-tls='maybe' is not one of: auto, on, off"),
    ({"split-stream-session": "day"}, "split-stream-session='day' is not one of: auto, run, round"),
    ({"split-stream-allow-plaintext": "yes"}, "split-stream-allow-plaintext='yes' must be a boolean"),
])
def test_stream_options_check_values_as_the_run_config_does(override, needle):
    """A bad split-stream-* value is the same ConfigError through the run config and through
    StreamOptions (the class a user of the API constructs)."""
    with pytest.raises(ConfigError) as e:
        parse_run_config({**pyproject_config(), "algo": "scala", "split-transport": "stream", **override})
    assert needle in str(e.value)
    (key, value), = override.items()
    with pytest.raises(ConfigError) as e:
        StreamOptions(**{key[len("split-stream-"):].replace("-", "_"): value})
    assert needle in str(e.value)


def test_stream_options_cross_key_rules_name_the_keys():
    cfg = {**pyproject_config(), "algo": "scala", "split-transport": "stream"}
    with pytest.raises(ConfigError, match="split-stream-host='0.0.0.0' binds every interface"):
        parse_run_config({**cfg, "split-stream-host": "0.0.0.0"})
    with pytest.raises(ConfigError, match="split-stream-allow-plaintext=true"):
        parse_run_config({**cfg, "split-stream-host": "10.1.2.3", "split-stream-tls": "off"})
    ok = parse_run_config({**cfg, "split-stream-host": "10.1.2.3", "split-stream-tls": "off",
                           "split-stream-allow-plaintext": True})
    assert ok.app.stream_options().allow_plaintext is True
    assert StreamOptions(allow_plaintext="false").allow_plaintext is False   # coerced as the run config does


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
