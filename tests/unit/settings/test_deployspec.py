from pathlib import Path

import pytest

from gaas.settings import deployspec
from gaas.settings.deployspec import SpecError

ROOT = Path(__file__).resolve().parents[3]


def test_shipped_deployment_parses():
    spec = deployspec.load(ROOT / "deploy" / "gaas.yaml")
    assert spec.default_model.name == "gaas-tiny"
    assert spec.model("gaas-tiny").source == str(ROOT / "models" / "gaas-tiny")


def test_hub_ids_stay_as_given(tmp_path):
    spec = deployspec.parse({"models": [{"name": "llama", "source": "meta-llama/Llama-3.2-1B"}]}, tmp_path)
    assert spec.model("llama").source == "meta-llama/Llama-3.2-1B"
    assert spec.default_model.name == "llama"  # the first when none is marked


@pytest.mark.parametrize(
    "doc, message",
    [
        ({}, "non-empty list"),
        ([], "must be a mapping"),
        ({"models": [{"name": "Bad Name", "source": "x"}]}, "name 'Bad Name'"),
        ({"models": [{"name": "a"}]}, "source is required"),
        ({"models": [{"name": "a", "source": "x", "max_model_len": "long"}]}, "max_model_len must be an integer"),
        ({"models": [{"name": "a", "source": "x", "colour": "red"}]}, "unknown field"),
        ({"models": [{"name": "a", "source": "x"}, {"name": "a", "source": "y"}]}, "listed twice"),
        (
            {"models": [{"name": "a", "source": "x", "default": True}, {"name": "b", "source": "y", "default": True}]},
            "only one model",
        ),
    ],
)
def test_bad_files_say_what_is_wrong(doc, message, tmp_path):
    with pytest.raises(SpecError, match=message):
        deployspec.parse(doc, tmp_path)


def test_unknown_model_lists_known_ones():
    spec = deployspec.load(ROOT / "deploy" / "gaas.yaml")
    with pytest.raises(SpecError, match="known: gaas-tiny, gaas-small, gaas-long"):
        spec.model("gpt-9")


def test_invalid_yaml(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("models: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        deployspec.load(f)
