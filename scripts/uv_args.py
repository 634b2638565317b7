"""What pip's configuration on this host says about where packages come from, as uv's arguments
(one per line), so that scripts/install.sh's uv installs exactly what pip would: the same indexes
(all of them searched, as pip does), local wheel folders, constraints and trusted certificates.

uv reads none of pip's files or PIP_* variables; this reads them through `pip config list` (the
environment's PIP_* first, then the install and global sections) and skips local folders and
file:// indexes that do not exist (pip ignores them with a warning)."""

from __future__ import annotations

import os
import subprocess
import sys

# pip's option -> uv's, for the options that say where packages come from.
OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint"}


def pip_config(python: str) -> dict[str, str]:
    """pip's effective settings by option name, as python's pip reads them."""
    return settings(subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout)


def settings(listing: str) -> dict[str, str]:
    """`pip config list`'s lines (section.option='value') by option: PIP_* (:env:) over install.*
    over global.*."""
    found: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        section, _, name = key.rpartition(".")
        found.setdefault(name, {})[section] = value.strip().strip("'\"")
    return {name: by.get(":env:") or by.get("install") or by.get("global", "")
            for name, by in found.items()}


def usable(location: str) -> bool:
    """A remote index, or a local folder/file:// index that exists."""
    if "://" in location and not location.startswith("file://"):
        return True
    return os.path.exists(location.removeprefix("file://"))


def uv_args(settings: dict[str, str]) -> list[str]:
    args = ["--index-strategy", "unsafe-best-match"]
    if settings.get("cert"):
        args.append("--system-certs")  # (pip's cert is the system's bundle, or one added to it)
    for name, flag in OPTIONS.items():
        for value in settings.get(name, "").split():
            if usable(value):
                args += [flag, value]
    return args


if __name__ == "__main__":
    print("\n".join(uv_args(pip_config(sys.argv[1] if len(sys.argv) > 1 else sys.executable))))
