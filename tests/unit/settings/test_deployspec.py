from pathlib import Path

import pytest

from gaas.settings import deployspec
from gaas.settings.deployspec import SpecError

ROOT = Path(__file__).resolve().parents[3]


def test_shipped_deployment_parses():
    spec = deployspec.load(ROOT / "deploy" / "gaas.yaml")
    assert spec.default_model.name == "gaas-tiny"
    assert spec.model("gaas-tiny").source == str(ROOT / "models" / "gaas-tiny")


def test_hub_ids_written_as_hub_ids_are_kept(tmp_path):
    spec = deployspec.parse({"models": [{"name": "llama", "source": "hub:meta-llama/Llama-3.2-1B"},
                                        {"name": "qwen", "hub": "Qwen/Qwen3-0.6B"}]}, tmp_path)
    assert spec.model("llama").source == "meta-llama/Llama-3.2-1B"
    assert spec.model("qwen").source == "Qwen/Qwen3-0.6B"
    assert spec.default_model.name == "llama"  # the first when none is marked


@pytest.mark.parametrize(
    "doc, message",
    [
        ({}, "non-empty list"),
        ([], "must be a mapping"),
        ({"models": [{"name": "Bad Name", "source": "/x"}]}, "name 'Bad Name'"),
        ({"models": [{"name": "a"}]}, "source is required"),
        ({"models": [{"name": "a", "source": "/x", "max_model_len": "long"}]}, "max_model_len must be an integer"),
        ({"models": [{"name": "a", "source": "/x", "colour": "red"}]}, "unknown field"),
        ({"models": [{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}]}, "listed twice"),
        (
            {"models": [{"name": "a", "source": "/x", "default": True}, {"name": "b", "source": "/y", "default": True}]},
            "only one model",
        ),
    ],
)
def test_bad_files_say_what_is_wrong(doc, message, tmp_path):
    with pytest.raises(SpecError, match=message):
        deployspec.parse(doc, tmp_path)


def test_unknown_model_lists_known_ones():
    spec = deployspec.load(ROOT / "deploy" / "gaas.yaml")
    with pytest.raises(SpecError, match="known: gaas-tiny, gaas-small, gaas-long, gaas-embed"):
        spec.model("gpt-9")


def test_invalid_yaml(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("models: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        deployspec.load(f)


GOOD = """\
models:
  - name: chat
    version: "2.0.0"
    source: models/chat
    preset: tiny
    replicas: 2
    engine: {max_num_seqs: 8, enforce_eager: auto}
    tenants: [acme, globex]
    pins: {acme: "1.0.0"}
    rollout:
      strategy: blue-green
      hold_seconds: 30
      guard: {ttft_p95_ms: {gold: 200}, window_seconds: 30}
qos:
  gold: {ttft_target_ms: 400}
"""


def test_a_pool_declares_its_version_replicas_engine_tenants_pins_and_rollout(tmp_path):
    spec = deployspec.parse_text(GOOD, tmp_path, "d.yaml")
    m = spec.model("chat")
    assert (m.version, m.replicas, dict(m.engine), m.tenants, dict(m.pins)) == (
        "2.0.0", 2, {"max_num_seqs": 8, "enforce_eager": "auto"}, ("acme", "globex"), {"acme": "1.0.0"})
    assert m.rollout.strategy == "blue-green" and m.rollout.hold_s == 30 and m.rollout.steps == (5, 25, 50, 100)
    assert m.rollout.guard.window_s == 30
    # The guard's targets: the model's own, else the tier's qos target.
    assert m.rollout.guard.ttft_targets_ms == {"gold": 200.0, "silver": 1500.0, "bronze": 5000.0}
    assert spec.served == [m] and spec.digest == deployspec.parse_text(GOOD, tmp_path).digest


def test_the_shipped_file_starts_workers_for_the_default_model_only_and_embeds_from_zero():
    spec = deployspec.load(ROOT / "deploy" / "gaas.yaml")
    assert [m.name for m in spec.served] == ["gaas-tiny", "gaas-embed"] and spec.model("gaas-tiny").replicas == "auto"
    embed = spec.model("gaas-embed")
    assert embed.engine["task"] == "embed" and (embed.autoscale.min, embed.autoscale.initial) == (0, 0)


@pytest.mark.parametrize("change, line, field, message", [
    (("    replicas: 2\n", "    replicas: many\n"), 6, "models[0].replicas", "replicas (a number or auto) must be an integer"),
    (("    replicas: 2\n", "    replicas: 2\n    colour: red\n"), 7, "models[0].colour", "unknown field 'colour'"),
    (("max_num_seqs: 8", "max_num_seqs: 0"), 7, "models[0].engine.max_num_seqs", None),
    (("max_num_seqs: 8", "gpus: 8"), 7, "models[0].engine.gpus", "unknown field 'gpus'"),
    (("strategy: blue-green", "strategy: big-bang"), 11, "models[0].rollout.strategy", "strategy must be one of canary"),
    (("hold_seconds: 30", "steps: [5, 50]"), 12, "models[0].rollout.steps", "must end at 100"),
    (("ttft_p95_ms: {gold: 200}", "ttft_p95_ms: {platinum: 200}"), 13, "models[0].rollout.guard.ttft_p95_ms.platinum",
     "unknown tier"),
    (('pins: {acme: "1.0.0"}', "pins: {acme: [1]}"), 9, "models[0].pins.acme", "is not a version"),
    (("  gold: {ttft_target_ms: 400}", "  gold: {ttft_target_ms: -1}"), 14, "qos", None),
    (("    replicas: 2\n", "    replicas: 2\n    autoscale: {min: 1, max: 3}\n"), 7, "models[0].autoscale",
     "give replicas (a fixed count) or autoscale (min and max), not both"),
    (("    replicas: 2\n", "    autoscale: {min: 4, max: 3}\n"), 6, "models[0].autoscale.min", "0 <= min <= max"),
    (("    replicas: 2\n", "    autoscale: {min: 1}\n"), 6, "models[0].autoscale", "autoscale needs max"),
    (("    replicas: 2\n", "    autoscale: {min: 1, max: 3, initial_scale: 0}\n"), 6,
     "models[0].autoscale.initial_scale", "initial_scale must be between min and max (1 to 3), not 0"),
    (("    replicas: 2\n", "    autoscale: {max: 2, step: 1}\n"), 6, "models[0].autoscale.step", "unknown field 'step'"),
    (("    replicas: 2\n", "    autoscale: {max: 2, target_kv_usage: 2}\n"), 6, "models[0].autoscale.target_kv_usage",
     "must be in (0, 1]"),
    (("    replicas: 2\n", "    replicas: 2\n    device: {kind: gpu, gpus: 2}\n"), 7, "models[0].device.gpus",
     "unknown device requirement 'gpus'"),
    (("    replicas: 2\n", "    replicas: 2\n    device: tpu\n"), 7, "models[0].device", "device must be one of any, cpu, gpu"),
])
def test_an_error_names_the_file_the_line_and_the_field(tmp_path, change, line, field, message):
    text = GOOD.replace(*change)
    assert text != GOOD
    with pytest.raises(SpecError) as err:
        deployspec.parse_text(text, tmp_path, "deploy/d.yaml")
    said = str(err.value)
    assert said.startswith(f"deploy/d.yaml:{line}: {field}: "), said
    if message:
        assert message in said


def test_a_second_model_of_the_same_name_is_placed_at_its_own_entry(tmp_path):
    doc = GOOD.replace("qos:", "  - name: chat\n    source: /x\nqos:")
    with pytest.raises(SpecError, match=r"d.yaml:14: models\[1\].name: model name\(s\) listed twice: chat"):
        deployspec.parse_text(doc, tmp_path, "d.yaml")


@pytest.mark.parametrize("source, preset, message", [
    ("/nonexistent/model", "", "does not exist, and no preset is given to build it"),
    ("/nonexistent/model", "huge", "unknown preset 'huge'"),
    ("/", "", "has no config.json"),
    ("/nonexistent/model", "tiny", None),
    ("org/hub-model", "", None),
])
def test_a_missing_source_is_named_before_anything_runs(source, preset, message):
    from gaas.model.build import check_source

    said = check_source("m", "2", source, preset)
    assert (said is None) if message is None else (message in said)


def test_an_autoscaled_pool_serves_from_min_and_keeps_its_policy_through_a_revision(tmp_path):
    text = GOOD.replace("    replicas: 2\n", "    autoscale: {min: 0, max: 3, target_requests: 2, cooldown_seconds: 10}\n")
    m = deployspec.parse_text(text, tmp_path, "d.yaml").model("chat")
    a = m.autoscale
    assert (a.min, a.max, a.target_requests, a.cooldown_s, a.initial) == (0, 3, 2.0, 10.0, 1)
    assert m.serves, "a pool at min 0 is served: its first request brings a worker"
    assert deployspec.ModelSpec.from_dict(m.as_dict()) == m
    assert m.at(m.pool()).autoscale == a


def test_a_pool_may_start_at_zero_and_keeps_that_through_a_revision(tmp_path):
    text = GOOD.replace("    replicas: 2\n", "    autoscale: {min: 0, max: 2, initial_scale: 0}\n")
    m = deployspec.parse_text(text, tmp_path, "d.yaml").model("chat")
    assert (m.autoscale.initial, m.replicas) == (0, 0) and m.serves
    assert deployspec.ModelSpec.from_dict(m.as_dict()) == m


def test_a_device_requirement_is_kept_with_its_pool(tmp_path):
    text = GOOD.replace("    replicas: 2\n", "    replicas: 2\n    device: {gpu_models: [H200], gpu_memory_gib: 80}\n")
    m = deployspec.parse_text(text, tmp_path, "d.yaml").model("chat")
    assert m.device == "gpu" and dict(m.device_needs) == {"kind": "gpu", "gpu_memory_gib": 80.0, "gpu_models": ["H200"]}
    assert m.requirement.describe() == "a GPU, H200, >= 80 GiB"
    assert deployspec.ModelSpec.from_dict(m.as_dict()) == m and m.at(m.pool()).requirement == m.requirement
    plain = deployspec.parse_text(GOOD, tmp_path, "d.yaml").model("chat")
    assert plain.device_needs == {} and plain.requirement.kind == "any"


SOURCED = "models:\n  - name: chat\n    version: '1'\n{source}    max_model_len: 512\n"


@pytest.mark.parametrize("lines, field, says", [
    ("    source: models/typo\n", "source", "chat: source 'models/typo' is neither a directory of the project"),
    ("    source: meta-llama/Llama-3.2-1B\n", "source", "write a hub model as hub:meta-llama/Llama-3.2-1B"),
    ("    source: hub:org/../x\n", "source", "'org/../x' is not a hub id"),
    ("    hub: org/a b\n", "hub", "'org/a b' is not a hub id"),
    ("    hub: [org]\n", "hub", "hub must be a hub id"),
    ("    source: /m\n    hub: org/m\n", "hub", "give source (a directory, or hub:ORG/NAME) or hub (ORG/NAME), not both"),
    ("    source: hub:org/m\n    preset: tiny\n", "preset", "a hub model is downloaded, not built"),
    ("    source: 12\n", "source", "source must be a directory or hub:ORG/NAME"),
])
def test_a_source_that_is_no_directory_buildable_or_hub_id_is_refused_at_its_line(tmp_path, lines, field, says):
    with pytest.raises(SpecError) as err:
        deployspec.parse_text(SOURCED.format(source=lines), tmp_path, "d.yaml")
    line = 4 + lines.count("\n") - 1 if field != "source" else 4
    assert str(err.value).startswith(f"d.yaml:{line}: models[0].{field}: "), str(err.value)
    assert says in str(err.value)


def test_a_relative_source_is_the_projects_directory_when_it_exists_or_a_preset_builds_it(tmp_path):
    (tmp_path / "models" / "here").mkdir(parents=True)
    here = deployspec.parse_text(SOURCED.format(source="    source: models/here\n"), tmp_path, "d.yaml")
    assert here.model("chat").source == str(tmp_path / "models" / "here")
    built = deployspec.parse_text(SOURCED.format(source="    source: models/new\n    preset: tiny\n"), tmp_path, "d.yaml")
    assert built.model("chat").source == str(tmp_path / "models" / "new")


def test_an_unknown_preset_is_refused_in_an_entry_that_serves_nothing_too(tmp_path):
    from gaas.model.build import check_sources

    text = SOURCED.format(source="    source: models/new\n    preset: huge\n")
    with pytest.raises(SpecError, match=r"d.yaml:4: models\[0\].source: chat 1: unknown preset 'huge'"):
        deployspec.parse_text(text, tmp_path, "d.yaml", check=check_sources)


@pytest.mark.parametrize("path", ["deploy/gaas.yaml", "deploy/k8s/base/gaas.yaml"])
def test_every_shipped_deployment_file_keeps_its_sources(path):
    from gaas.model.build import check_sources

    spec = deployspec.load(ROOT / path, check=check_sources)
    assert all(m.source.startswith(str(ROOT / "models")) and m.preset for m in spec.models)


def test_a_file_nested_past_what_yaml_reads_is_a_spec_error():
    with pytest.raises(SpecError, match="d.yaml is nested too deeply to read"):
        deployspec.parse_text("models: " + "[" * 5000 + "]" * 5000, ROOT, "d.yaml")
