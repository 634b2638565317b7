"""`gaas` before `make proto`: it generates the gRPC modules itself, or says what to run."""

from __future__ import annotations

import pytest

from gaas.cli import main as cli_main


def test_gaas_generates_the_grpc_modules_when_a_proto_is_newer(monkeypatch, capsys):
    generated = []
    monkeypatch.setattr(cli_main.protogen, "is_stale", lambda: True)
    monkeypatch.setattr(cli_main.protogen, "generate", lambda: generated.append(True))
    assert cli_main.ensure_generated() is None
    assert generated == [True]
    assert "make proto" in capsys.readouterr().err


def test_gaas_says_what_to_run_when_it_cannot_generate_them(monkeypatch):
    def no_grpc_tools():
        raise ModuleNotFoundError("No module named 'grpc_tools'")

    monkeypatch.setattr(cli_main.protogen, "is_stale", lambda: True)
    monkeypatch.setattr(cli_main.protogen, "generate", no_grpc_tools)
    said = cli_main.ensure_generated()
    assert "make install" in said and "make proto" in said and "grpc_tools" in said


def test_gaas_that_cannot_generate_them_exits_2_saying_so(monkeypatch, capsys):
    monkeypatch.setattr(cli_main, "ensure_generated", lambda: "run `make install`, then `make proto`")
    assert cli_main.main(["status"]) == 2
    assert "make proto" in capsys.readouterr().err


def test_gaas_with_its_modules_generated_lists_its_commands(monkeypatch, capsys):
    monkeypatch.setattr(cli_main.protogen, "is_stale", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        cli_main.main(["--help"])
    assert exit_.value.code == 0 and "gaas up" in capsys.readouterr().out
