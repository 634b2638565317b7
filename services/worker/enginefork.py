"""How a CPU engine's process starts: forked from a server that holds vLLM imported already
(multiprocessing's forkserver), rather than spawned afresh once the worker has built vLLM's config.

On the CPU vLLM starts its EngineCore with `spawn`: a new interpreter that imports vLLM and torch
again (~17 CPU s here), after the worker's own import of them. Instead the engine cores are forked
from a server process with no gRPC threads:
- forked from the worker itself, once the worker has imported vLLM and before any thread starts,
  where the worker started with what the engine needs from its start (the libraries and OpenMP
  settings that only take effect when an interpreter starts: placement.cpu_engine_environment,
  which `gaas up` gives its CPU workers): vLLM is imported once per worker, not twice;
- otherwise (a worker started by hand or by a Kubernetes pod without them) a new interpreter given
  them, which imports vLLM on the host's other core while the worker imports it too.
What a spawned process would have had, an engine process has too: the starting process's
environment at the moment vLLM starts it (EngineProcess).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import socket
from multiprocessing import connection, context, forkserver

from gaas.host import placement

log = logging.getLogger(__name__)

# What lets a process forked from the server set its title: imported by the server alone.
TITLE_MODULE = "services.worker.enginetitle"
# What vLLM's engine core process imports on the CPU: its loop, the in-process executor, the CPU
# model runner and the Llama family's model code (other architectures import theirs in the child).
ENGINE_MODULES = (
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
    """Set env in this process's environment and start the engine's server with it on cpus (the
    engine's cores, not this process's), holding modules imported. Where this process started with
    env already, the modules are imported here and now and the server is forked from this process:
    call it before any thread starts (gRPC's, the event loop's executor). Otherwise the server is a
    new interpreter that imports them in the background (this returns at once). Returns the context
    that forks from it; None where it cannot start (vLLM spawns then)."""
    global _context
    started_with = all(os.environ.get(k) == v for k, v in env.items())
    os.environ.update(env)
    try:
        if started_with:
            _fork_server(modules)
        else:
            multiprocessing.set_forkserver_preload([TITLE_MODULE, *modules])
            forkserver.ensure_running()
    except (OSError, ValueError) as exc:
        log.warning("cannot start the engine's forkserver (%s); vLLM spawns its engine process instead", exc)
        return None
    if cpus:
        placement.pin_descendants(os.getpid(), cpus)
    _context = EngineContext()
    return _context


def _fork_server(modules: tuple[str, ...]) -> None:
    """Import modules here, then fork multiprocessing's forkserver from this process (what
    forkserver.ensure_running does with a new interpreter): its socket, and the pipe whose end
    (every process that may ask it for a fork holds the write side) stops it."""
    for name in modules:
        importlib.import_module(name)
    server = forkserver._forkserver
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server: serves until every process that held alive_w is gone
            status = 0
            try:
                os.close(alive_w)
                importlib.import_module(TITLE_MODULE)
                forkserver.main(listener.detach(), alive_r, [])
            except SystemExit:
                pass
            except BaseException:  # noqa: BLE001 - a child's last word, then its own exit
                log.exception("the engine's forkserver failed")
                status = 1
            finally:
                os._exit(status)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


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
