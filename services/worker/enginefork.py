"""How a CPU engine's process starts: forked from a server that imported vLLM while the worker
started (multiprocessing's forkserver), rather than spawned afresh once the worker has built vLLM's
config; and the environment it needs from its start (cpu_engine_environment).

On the CPU vLLM starts its EngineCore with `spawn`: a new interpreter that imports vLLM and torch
again, and only once the worker's own import of them is done. The forkserver imports them on the
host's other core meanwhile, in a process with no gRPC threads, and forks each engine core from
there. What a spawned process would have had, this one has too: the starting process's environment
at the moment vLLM starts it (EngineProcess), and the libraries and OpenMP settings that only take
effect when an interpreter starts (given to the server when it starts, `start_server`'s env).
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import multiprocessing
import os
from multiprocessing import context, forkserver

from gaas.host import placement
from gaas.settings.worker import WorkerSettings

log = logging.getLogger(__name__)

# What vLLM's engine core process imports on the CPU: its loop, the in-process executor, the CPU
# model runner and the Llama family's model code (other architectures import theirs in the child);
# first, what lets a process forked from the server set its title (enginetitle).
ENGINE_MODULES = (
    "services.worker.enginetitle",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.model_executor.models.llama",
)


class EngineProcess(context.ForkServerProcess):
    """A process forked by the forkserver that runs in the environment its starter had when it
    called start(), as a spawned process does (vLLM sets variables for its engine just before)."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        if os.environ.get("LD_PRELOAD", "") != self._environ.get("LD_PRELOAD", ""):
            log.warning("the engine's process runs with LD_PRELOAD=%r from the worker's start, not %r",
                        os.environ.get("LD_PRELOAD", ""), self._environ.get("LD_PRELOAD", ""))
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class EngineContext(context.ForkServerContext):
    """multiprocessing's forkserver context whose processes are EngineProcess."""

    Process = EngineProcess


_context: EngineContext | None = None




def start_server(
    env: dict[str, str], cpus: set[int], modules: tuple[str, ...] = ENGINE_MODULES,
) -> EngineContext | None:
    """Set env in this process's environment and start the forkserver with it on cpus (the engine's
    cores, not this process's: the two import side by side), importing modules there now (in the
    background: this returns at once). Returns the context that forks from it; None where it
    cannot start (vLLM spawns then)."""
    global _context
    os.environ.update(env)
    try:
        multiprocessing.set_forkserver_preload(list(modules))
        forkserver.ensure_running()
    except (OSError, ValueError) as exc:
        log.warning("cannot start the engine's forkserver (%s); vLLM spawns its engine process instead", exc)
        return None
    if cpus:
        placement.pin_descendants(os.getpid(), cpus)
    _context = EngineContext()
    return _context


def cpu_engine_environment(s: WorkerSettings) -> dict[str, str]:
    """What a CPU engine's processes need in their environment from their start: the cache's size
    (vLLM otherwise reserves most of the RAM for it), one OpenMP thread per core of the worker's
    bind (placement.engine_executor), and the libraries vLLM's CPU platform preloads for its engine
    process (torch's libgomp unless an OpenMP is preloaded already, its bundled tcmalloc), as its
    check_and_update_config sets LD_PRELOAD before spawning one."""
    _, env = placement.engine_executor(s.executor, False, os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
    env["VLLM_CPU_KVCACHE_SPACE"] = str(s.kv_cache_gib)
    preload = os.environ.get("LD_PRELOAD", "")
    torch_dir, vllm_dir = _package_dir("torch"), _package_dir("vllm")
    if torch_dir and not any(lib in preload for lib in ("libomp", "libgomp", "libiomp")):
        site = os.path.dirname(torch_dir)
        found = glob.glob(os.path.join(site, "torch.libs", "libgomp*.so*")) + glob.glob(
            os.path.join(torch_dir, "lib", "libgomp*.so*"))
        if found:
            preload = f"{preload}:{found[0]}" if preload else found[0]
    if vllm_dir and "libtcmalloc" not in preload:
        found = glob.glob(os.path.join(vllm_dir, "libs", "libtcmalloc_minimal*.so*")) or glob.glob(
            os.path.join(vllm_dir, "libs", "libtcmalloc.so*"))
        if found:
            preload = f"{found[0]}:{preload}" if preload else found[0]
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def start_vllm_engines_from_server() -> None:
    """Have vLLM start its engine core from the server, when start_server has started one."""
    ctx = _context
    if ctx is None:
        return
    import vllm.v1.engine.utils as engine_utils

    if not callable(getattr(engine_utils, "get_mp_context", None)):
        log.warning("this vLLM starts its engine core otherwise; it is spawned, not forked from the preloaded server")
        return
    engine_utils.get_mp_context = lambda: ctx
