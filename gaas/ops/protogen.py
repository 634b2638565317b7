"""Generate the Python gRPC modules (gaas/v1/*_pb2*.py) and Envoy's descriptor set from protos/.

Run by `make proto` (and by `make run` / `make test` through it). Only regenerates when a .proto
is newer than its outputs, so it is cheap to call every time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT  # protos/gaas/v1/x.proto -> gaas/v1/x_pb2.py
DESCRIPTOR_SET = ROOT / "build" / "gaas.pb"
EXTRA_DESCRIPTORS = ["google/rpc/error_details.proto"]


def _include_dirs() -> list[str]:
    """protos/ plus the directories holding google/api/*.proto and google/protobuf/*.proto."""
    import google.api
    import grpc_tools

    dirs = [str(PROTO_DIR)]
    api_root = Path(google.api.__path__[0]).parent.parent  # site-packages
    dirs.append(str(api_root))
    dirs.append(str(Path(grpc_tools.__file__).parent / "_proto"))
    return dirs


def _protos() -> list[Path]:
    return sorted((PROTO_DIR / "gaas" / "v1").glob("*.proto"))


def is_stale() -> bool:
    protos = _protos()
    newest = max(p.stat().st_mtime for p in protos)
    outputs = [OUT_DIR / "gaas" / "v1" / (p.stem + "_pb2.py") for p in protos] + [DESCRIPTOR_SET]
    return any(not o.exists() or o.stat().st_mtime < newest for o in outputs)


def generate(force: bool = False) -> bool:
    """Regenerate when stale (or forced). Returns True when it ran protoc."""
    from grpc_tools import protoc

    if not force and not is_stale():
        return False
    protos = [str(p.relative_to(PROTO_DIR)) for p in _protos()]
    DESCRIPTOR_SET.parent.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{d}" for d in _include_dirs()]
    python = ["protoc", *includes, f"--python_out={OUT_DIR}", f"--grpc_python_out={OUT_DIR}", f"--pyi_out={OUT_DIR}"]
    # Envoy's descriptor set also holds google.rpc's error details, so the transcoder can render
    # the ErrorInfo / RetryInfo that statuses carry (gaas.runtime.status) into the HTTP body.
    descriptors = ["protoc", *includes, "--include_imports", f"--descriptor_set_out={DESCRIPTOR_SET}", *EXTRA_DESCRIPTORS]
    for args in (python + protos, descriptors + protos):
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    init = OUT_DIR / "gaas" / "v1" / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC modules of the gaas.v1 API (see protos/). Do not edit."""\n')
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="regenerate even when up to date")
    args = parser.parse_args(argv)
    ran = generate(force=args.force)
    print("generated gaas/v1 and build/gaas.pb" if ran else "gaas/v1 and build/gaas.pb are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
