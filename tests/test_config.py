"""Params validation: unknown keys and wrong types fail naming the key, the file and the line."""

from pathlib import Path

import pytest
import yaml

from eaglekit.config import ParamsError, load_params, params_from_sections
from eaglekit.paths import REPO_ROOT

SCENARIOS = sorted((REPO_ROOT / "params").glob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=[path.stem for path in SCENARIOS])
def test_every_shipped_scenario_validates(path):
    params = load_params(path)
    assert params.run.name


def test_required_scenarios_exist():
    assert {"smoke", "demo", "kimi_k25_big_run"} <= {path.stem for path in SCENARIOS}


def test_kimi_scenario_matches_the_seed():
    params = load_params(REPO_ROOT / "params" / "kimi_k25_big_run.yaml")
    config = params.target.config
    assert config["num_hidden_layers"] == 61 and config["hidden_size"] == 7168
    assert params.target.capture_layers == [2, 30, 58]
    assert params.endpoints and params.endpoints[0].url.startswith("http")
    assert params.endpoints[0].api_key_env  # the key itself never appears in params


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return path


def test_unknown_key_names_key_file_and_line(tmp_path):
    path = write(tmp_path, "run:\n  name: x\ntarget:\n  modle: foo\n")
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    message = str(caught.value)
    assert f"{path}:4" in message and "unknown key 'target.modle'" in message


def test_unknown_section_fails(tmp_path):
    with pytest.raises(ParamsError, match="unknown key 'trainig'"):
        load_params(write(tmp_path, "trainig:\n  steps: 3\n"))


def test_wrong_type_names_key_and_value(tmp_path):
    path = write(tmp_path, "run:\n  name: x\n  seed: '3'\n")
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    assert (
        f"{path}:3" in str(caught.value) and "'run.seed'" in str(caught.value) and "'3'" in str(caught.value)
    )


def test_nested_list_error_points_into_the_list(tmp_path):
    path = write(tmp_path, "endpoints:\n  - url: http://a:1/v1\n  - url: ftp://b\n")
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    assert "endpoints.1.url" in str(caught.value) and f"{path}:3" in str(caught.value)


def test_a_literal_api_key_is_refused(tmp_path):
    with pytest.raises(ParamsError, match="unknown key 'endpoints.0.api_key'"):
        load_params(write(tmp_path, "endpoints:\n  - url: http://a:1/v1\n    api_key: sk-123\n"))


def test_invalid_yaml_names_the_line(tmp_path):
    with pytest.raises(ParamsError, match=r"scenario.yaml:2: not valid YAML"):
        load_params(write(tmp_path, "run:\n  name: [unclosed\n"))


def test_params_are_frozen():
    params = params_from_sections({})
    with pytest.raises(Exception):
        params.run.seed = 3


def test_api_key_is_read_from_the_environment_at_call_time(monkeypatch):
    params = params_from_sections(
        {"endpoints": [{"url": "http://a:1/v1", "api_key_env": "EAGLEKIT_TEST_KEY"}]}
    )
    with pytest.raises(ParamsError, match="EAGLEKIT_TEST_KEY is not set"):
        params.endpoints[0].api_key()
    monkeypatch.setenv("EAGLEKIT_TEST_KEY", "sk-secret")
    assert params.endpoints[0].api_key() == "sk-secret"
    assert "sk-secret" not in yaml.safe_dump(params.sections())


def _requirement_names(requirements):
    import re

    return {
        re.split(r"[<>=\[ ;]", requirement.strip(), maxsplit=1)[0].lower() for requirement in requirements
    }


def test_environment_yml_lists_the_same_packages_as_pyproject():
    import tomllib

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    expected = _requirement_names(pyproject["project"]["dependencies"])
    environment = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    listed = []
    for item in environment["dependencies"]:
        listed.extend(item["pip"] if isinstance(item, dict) else [item])
    names = _requirement_names(listed) - {"python", "pip"}
    assert expected <= names, f"missing from environment.yml: {sorted(expected - names)}"
    pinned = [item for item in listed if isinstance(item, str) and item.startswith("torch")]
    assert pinned == ["torch==2.13.0"]


def test_an_alias_bomb_fails_fast_with_a_clear_message(tmp_path):
    import time

    levels = "".join(f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]\n" for n in range(1, 9))
    bomb = write(tmp_path, "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + levels)
    assert len(bomb.read_bytes()) < 1024  # 9^9 nodes once expanded
    started = time.monotonic()
    with pytest.raises(ParamsError, match=r"scenario.yaml:9: not valid YAML: more than 64 aliases"):
        load_params(bomb)
    assert time.monotonic() - started < 1.0

    # Few aliases, each to a large node: refused by the expanded size, also at once.
    wide = write(
        tmp_path,
        "a: &a ["
        + ", ".join(["x"] * 400)
        + "]\nb: &b ["
        + ", ".join(["*a"] * 60)
        + "]\nc: [*b, *b, *b, *b]\n",
    )
    started = time.monotonic()
    with pytest.raises(ParamsError, match="aliases expand to more than 100,000 nodes"):
        load_params(wide)
    assert time.monotonic() - started < 1.0
    with pytest.raises(
        ParamsError, match=r"scenario.yaml:1: not valid YAML: an alias refers to the node that contains it"
    ):
        load_params(write(tmp_path, "a: &a [1, *a]\n"))


def test_a_few_aliases_are_fine(tmp_path):
    params = load_params(
        write(
            tmp_path,
            "run: &run\n  name: shared\ntarget:\n  model: embedded:smollm2-135m-instruct\n"
            "training:\n  data_sizes: &sizes [4, 8]\n",
        )
    )
    assert params.run.name == "shared" and params.training.data_sizes == [4, 8]


def test_a_repeated_key_names_both_lines(tmp_path):
    path = write(tmp_path, "run:\n  name: first\n  seed: 1\n  name: second\n")
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    assert f"{path}:4: key 'run.name' repeated (first at line 2)" in str(caught.value)
    nested = write(tmp_path, "endpoints:\n  - url: http://a:1/v1\n    model: m\n    model: n\n")
    with pytest.raises(
        ParamsError, match=r"scenario.yaml:4: key 'endpoints.0.model' repeated \(first at line 3\)"
    ):
        load_params(nested)
    with pytest.raises(ParamsError, match=r"scenario.yaml:3: key 'run' repeated \(first at line 1\)"):
        load_params(write(tmp_path, "run:\n  name: a\nrun:\n  seed: 2\n"))


def test_a_non_utf8_params_file_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    assert f"{path}:2: not UTF-8 (byte 0xe9" in str(caught.value) and "save the params file as UTF-8" in str(
        caught.value
    )
    bom = tmp_path / "bom.yaml"
    bom.write_bytes("\ufeffrun:\n  name: bom\n".encode("utf-8"))
    assert load_params(bom).run.name == "bom"


def test_the_cli_reports_bad_params_files_without_a_traceback(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"run:\n  name: caf\xe9\n")
    result = subprocess.run(
        [sys.executable, "-m", "eaglekit.cli", "run", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{path}:2: not UTF-8" in result.stderr


def test_training_defaults_live_in_config_only():
    """TrainSettings (the library's) and TrainingParams (the params') must not disagree on a default: a
    notebook run and a direct library call of the same recipe would train different drafts."""
    from eaglekit.config import TrainingParams
    from eaglekit.training import TrainSettings

    params_defaults, settings_defaults = TrainingParams(), TrainSettings().to_dict()
    shared = [name for name in settings_defaults if name in TrainingParams.model_fields]
    assert len(shared) >= 20  # the recipe, the schedule and the batch shape are all shared
    differing = {
        name: (settings_defaults[name], getattr(params_defaults, name))
        for name in shared
        if settings_defaults[name] != getattr(params_defaults, name)
    }
    assert differing == {}


def test_ttt_steps_default_to_the_served_chain_and_never_fall_short_of_it(tmp_path):
    """ttt_steps unset (or null) resolves to speculative_tokens at validation, so readers see an int; a
    ttt_steps below speculative_tokens is refused naming both fields (served positions past the unroll
    would never have been trained on the draft's own predictions)."""
    from eaglekit.config import TrainingParams

    assert TrainingParams().ttt_steps == TrainingParams().speculative_tokens == 3
    assert TrainingParams(speculative_tokens=5).ttt_steps == 5
    assert (
        load_params(
            write(tmp_path, "training:\n  ttt_steps: null\n  speculative_tokens: 4\n")
        ).training.ttt_steps
        == 4
    )
    assert (
        TrainingParams(ttt_steps=7, speculative_tokens=3).ttt_steps == 7
    )  # deeper than served: fine (the Kimi scenario)
    resolved = TrainingParams(speculative_tokens=2)
    assert (
        TrainingParams.model_validate(resolved.model_dump()) == resolved
    )  # a dump re-validates (the runner's round trip)
    # Unset stays unset in a dump: the injected parameters edited to serve deeper follow it; a set value
    # stays.
    assert TrainingParams.model_validate({**resolved.model_dump(), "speculative_tokens": 5}).ttt_steps == 5
    assert (
        TrainingParams.model_validate(
            {**TrainingParams(ttt_steps=7).model_dump(), "speculative_tokens": 5}
        ).ttt_steps
        == 7
    )
    assert (
        load_params(write(tmp_path, "training:\n  ttt_steps: null\n")).sections()["training"]["ttt_steps"]
        is None
    )
    path = write(tmp_path, "run:\n  name: x\ntraining:\n  ttt_steps: 2\n")
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    message = str(caught.value)
    assert f"{path}:3" in message and "ttt_steps 2 < speculative_tokens 3" in message
    with pytest.raises(ParamsError, match="speculative_tokens"):
        load_params(
            write(tmp_path, "training:\n  speculative_tokens: '3'\n")
        )  # a wrong type fails on its own key


def test_the_measured_recipe_is_the_default():
    """docs/recipe_ablation.md: lr 3e-4, an anneal of 0.75 x the steps taken to converge, TTT as deep as
    served."""
    from eaglekit.config import TrainingParams

    defaults = TrainingParams()
    assert (defaults.learning_rate, defaults.decay_steps, defaults.decay_fraction, defaults.ttt_steps) == (
        3.0e-4,
        None,
        0.75,
        3,
    )
    assert (defaults.draft_vocab_size, defaults.micro_batch_size, defaults.grad_accumulation_steps) == (
        None,
        1,
        4,
    )  # unchanged


def test_draft_shape_names_are_the_draft_packages_presets():
    """params may name exactly the presets eaglekit.draft.config defines (config does not import the
    draft)."""
    import typing

    from eaglekit.config import TrainingParams
    from eaglekit.draft.config import DRAFT_SHAPES

    assert set(typing.get_args(TrainingParams.model_fields["draft_shape"].annotation)) == {
        "auto",
        *DRAFT_SHAPES,
    }
