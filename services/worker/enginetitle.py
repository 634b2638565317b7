"""Imported by the engine's forkserver alone (enginefork.ENGINE_MODULES), before it forks: uses
setproctitle once, which finds the command line's memory on its first use. A process forked from
the server cannot find it itself, so vLLM's engine would not show as VLLM::EngineCore (in ps, and
to bench.common.chaos, which finds the engine so).

Never imported by the worker: that first use moves a process's environment out of the memory
/proc/PID/environ reads, and what each process of the mesh holds is read there (test_trust).
"""

try:
    import setproctitle
except ImportError:  # (vLLM titles nothing without it either)
    pass
else:
    setproctitle.getproctitle()
