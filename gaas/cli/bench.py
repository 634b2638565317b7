"""`gaas bench NAME [ARGS...]`: one of the project's benchmarks (bench/ in the checkout this gaas runs
from; `make bench` runs them all), with its own options (`gaas bench NAME --help`). `gaas bench`
alone lists them. Each prints its table and writes its JSON under bench/results/.

  gaas bench sits              the SITS2026 scorecard: six dimensions on a live mesh (its own, or
                               --target RUN_DIR), beside the seed's columns; JSON, PNG and HTML
  gaas bench qos --seconds 20  any other benchmark, by its module's name"""

from __future__ import annotations

import argparse
import ast
import os
import sys

from gaas.cli.common import ROOT, fail

BENCH = ROOT / "bench"


def benchmarks() -> dict[str, str]:
    """name -> the first line of its docstring, for each runnable module of bench/ (a main(), or a
    package with __main__)."""
    out = {}
    for path in sorted(BENCH.iterdir()) if BENCH.is_dir() else ():
        if path.is_dir() and (path / "__main__.py").exists():
            source = path / "__init__.py"
        elif path.suffix == ".py" and not path.name.startswith("_"):
            source = path
        else:
            continue
        try:
            tree = ast.parse(source.read_text())
        except (OSError, SyntaxError):
            continue
        if source is path and not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue
        doc = ast.get_docstring(tree) or ""
        out[path.stem if path.is_file() else path.name] = " ".join(doc.split("\n\n")[0].split())
    return out


def cmd_bench(args) -> int:
    found = benchmarks()
    if not found:
        return fail(f"no benchmarks here: they live in bench/ of the GaaS checkout ({BENCH} is missing); "
                    "run gaas from a clone of the repository")
    if not args.name:
        print("benchmarks (gaas bench NAME --help for each one's options; `make bench` runs them all):")
        for name, doc in found.items():
            print(f"  {name:<14} {doc[:100] + ('...' if len(doc) > 100 else '')}")
        return 0
    if args.name not in found:
        return fail(f"no benchmark named {args.name!r}; there are: {', '.join(found)}", 2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    os.execve(sys.executable, [sys.executable, "-m", f"bench.{args.name}", *args.args], env)
    return 0  # (not reached)


def register(sub) -> None:
    """`gaas bench`."""
    p = sub.add_parser("bench", help="run a benchmark (sits: the SITS2026 scorecard); alone: list them",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", default="", help="the benchmark (bench/NAME.py or bench/NAME/)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its own options")
    p.set_defaults(func=cmd_bench)
