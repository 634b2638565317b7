"""Every service's settings described from their declarations: the markdown table of
docs/configuration.md (between its settings:begin and settings:end markers) and each service's
--help. One source, so neither drifts from what the services read.

    python -m gaas.settings.docs                            # print the table
    python -m gaas.settings.docs --write docs/configuration.md  # replace the marked block
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from gaas.settings.env import Variable, variables
from gaas.settings.services import SETTINGS

BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def _default_cell(v: Variable) -> str:
    if v.required:
        return "required"
    shown = v.shown_default()
    return f"`{shown}`" if shown else ""


def markdown() -> str:
    """Every service's settings, a table per service: variable, default, meaning."""
    out = ["Unset or empty, a variable takes its default. `gaas up` sets the ones that place a service "
           "in the mesh (its replica name, ports, sockets, Redis user, the topology's worker options) and "
           "passes the others on from its own environment."]
    for service, cls in SETTINGS.items():
        out += ["", f"#### {service} (`python -m services.{service}.server`)", "",
                "| variable | default | meaning |", "|---|---|---|"]
        for v in variables(cls):
            out.append(f"| `{v.name}` | {_default_cell(v)} | {v.var.help.replace('|', chr(92) + '|')} |")
    return "\n".join(out) + "\n"


def help_epilog(service: str, extra: str = "") -> str:
    """A service's settings for its --help (argparse's epilog, RawDescriptionHelpFormatter); extra:
    lines about what else of the environment it reads."""
    vs = variables(SETTINGS[service])
    width = max(len(v.name) for v in vs) + 2
    lines = ["environment (unset or empty: the default):"]
    for v in vs:
        default = "Required." if v.required else f"Default {v.shown_default() or 'empty'}."
        help = v.var.help if v.var.help.endswith(".") else v.var.help + "."
        lines += textwrap.wrap(f"{help} {default}", 100, initial_indent=f"  {v.name:<{width}}",
                               subsequent_indent=" " * (width + 2))
    return "\n".join(lines) + "\n" + extra


def replace_block(text: str, table: str) -> str:
    """text with what lies between BEGIN and END replaced by table; ValueError when it has no such block."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[: start + len(BEGIN)] + "\n" + table + text[end:]


def block(text: str) -> str | None:
    """What lies between BEGIN and END in text (None when it has no such block)."""
    start, end = text.find(BEGIN), text.find(END)
    return None if start < 0 or end < start else text[start + len(BEGIN) : end]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print every service's settings as markdown, or write them into a "
                                f"file's {BEGIN} ... {END} block.")
    p.add_argument("--write", metavar="FILE", help="replace the block in FILE (docs/configuration.md)")
    args = p.parse_args(argv)
    if not args.write:
        sys.stdout.write(markdown())
        return 0
    path = Path(args.write)
    try:
        path.write_text(replace_block(path.read_text(), markdown()))
    except (OSError, ValueError) as exc:
        print(f"cannot write the settings into {path}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
