"""`gaas rollout status` as it prints a roll-out, and `gaas apply` / `gaas diff` refusing a bad file
before calling anything."""

from __future__ import annotations

from gaas.cli.deploy import rollout_text
from gaas.cli.main import main

FIGURES = {"requests": 40, "errors": 1, "error_rate": 0.025, "ttft_p95_ms": {"gold": {"p95": 310.0, "n": 40}},
           "tokens_per_s": 120.0}


def status(**kw) -> dict:
    return {"model": "m", "stable": "1", "version": "2", "strategy": "canary", "state": "progressing", "weight": 25,
            "shadow": 0, "step": 1, "steps": [5, 25, 50, 100], "since": 0.0, "started_at": 0.0,
            "figures": {"1": FIGURES, "2": FIGURES},
            "decisions": [{"at": 0.0, "state": "starting", "weight": 0, "reason": "canary of 2 over 1", "figures": {}}],
            **kw}


def test_a_live_rollout_shows_its_step_the_guards_figures_and_decisions():
    text = rollout_text(status())
    assert text.splitlines()[0] == "m: canary of 2 over 1: at 25% (step 2 of 4)"
    assert "TTFT p95 gold" in text and "310 ms (n=40)" in text and "1 (2.5%)" in text
    assert "starting       0%  canary of 2 over 1" in text


def test_an_ended_rollout_shows_the_figures_its_last_decision_was_made_on():
    back = {"at": 30.0, "state": "rolled-back", "weight": 0, "reason": "rolled back: slow",
            "figures": {"new": FIGURES, "stable": None}}
    text = rollout_text(status(state="rolled-back", weight=0, figures={"1": {}, "2": {}},
                               decisions=[*status()["decisions"], back]))
    assert "m: canary of 2 over 1: rolled-back" in text and "310 ms (n=40)" in text and "rolled back: slow" in text


def test_apply_and_diff_refuse_a_bad_file_with_its_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GAAS_HOME", str(tmp_path))  # (main sets it: restored after the test)
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    source: /nonexistent\n    replicas: lots\n")
    for command in ("apply", "diff"):
        assert main([command, "-f", str(bad), "--run-dir", str(tmp_path)]) == 2
        assert f"{bad}:4: models[0].replicas: replicas (a number or auto) must be an integer" in capsys.readouterr().err
    assert main(["apply", "-f", str(tmp_path / "none.yaml"), "--run-dir", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
