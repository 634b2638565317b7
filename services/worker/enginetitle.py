"""Imported by the engine's forkserver alone (enginefork.TITLE_MODULE), before it forks: uses
setproctitle once, which finds the command line's memory on its first use. A process forked from
the server cannot find it itself, so vLLM's engine would not show as VLLM::EngineCore (in ps, and
to bench.common.chaos, which finds the engine so).

setproctitle finds the command line just before the first environment string the process started
with, where environ[0] points at the start. A server forked from the worker starts after the worker
(and vLLM's import) changed its environment, which can move environ[0] off that string: it is
pointed back there first (Linux's /proc/self/stat says where the environment's memory starts).

Never imported by the worker: that first use moves a process's environment out of the memory
/proc/PID/environ reads, and what each process of the mesh holds is read there (test_trust).
"""

import ctypes


def _first_environment_string_where_the_kernel_put_it() -> None:
    try:
        with open("/proc/self/stat") as f:
            env_start = int(f.read().rsplit(")", 1)[1].split()[-3])  # (env_start, env_end, exit_code)
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
        if environ and environ[0] and environ[0] != env_start:
            environ[0] = env_start
    except (OSError, ValueError, IndexError):
        pass  # (no title then: vLLM's engine runs all the same)


try:
    import setproctitle
except ImportError:  # (vLLM titles nothing without it either)
    pass
else:
    _first_environment_string_where_the_kernel_put_it()
    setproctitle.getproctitle()
