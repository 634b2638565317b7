"""scripts/uv_args.py: uv is told where pip's configuration takes packages from, so the install
gets the same packages with either tool (the versions were compared whole, `pip freeze` against
`uv pip freeze`, when uv came in)."""

from __future__ import annotations

import runpy

from tests.conftest import ROOT

uv = runpy.run_path(str(ROOT / "scripts" / "uv_args.py"))


def test_the_environment_wins_over_the_install_and_global_sections():
    listing = ("global.find-links='/global'\ninstall.find-links='/install'\n:env:.find-links='/env'\n"
               "global.constraint='/etc/c.txt'\nglobal.cert=\"/etc/ssl/ca.crt\"\nno equals sign here\n")
    assert uv["settings"](listing) == {"find-links": "/env", "constraint": "/etc/c.txt", "cert": "/etc/ssl/ca.crt"}


def test_every_index_is_searched_and_missing_local_ones_are_left_out(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    args = uv["uv_args"]({"index-url": "https://pypi.example/simple",
                          "extra-index-url": f"file://{tmp_path} file:///nowhere/simple https://more.example/simple",
                          "find-links": f"{wheels} /nowhere", "constraint": str(tmp_path), "cert": "/etc/ssl/ca.crt"})
    assert args == ["--index-strategy", "unsafe-best-match", "--system-certs",
                    "--index-url", "https://pypi.example/simple",
                    "--extra-index-url", f"file://{tmp_path}", "--extra-index-url", "https://more.example/simple",
                    "--find-links", str(wheels), "--constraint", str(tmp_path)]


def test_no_configuration_is_pypi_alone():
    assert uv["uv_args"]({}) == ["--index-strategy", "unsafe-best-match"]
