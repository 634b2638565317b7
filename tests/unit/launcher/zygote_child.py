"""A module the zygote's tests fork (tests/unit/launcher/test_zygote.py): run as __main__, it
writes what its process is to $GAAS_TEST_REPORT, prints a line, then exits with $GAAS_TEST_EXIT
or, with GAAS_TEST_WAIT set, waits for a signal."""

import json
import os
import signal
import sys

# What the zygote imports for the processes it forks (as the worker names vLLM's modules).
ZYGOTE_PRELOAD = ("decimal",)

if __name__ == "__main__":
    with open(os.environ["GAAS_TEST_REPORT"], "w") as f:
        json.dump({"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "cwd": os.getcwd(),
                   "cpus": sorted(os.sched_getaffinity(0)), "env": dict(os.environ),
                   "preloaded": "decimal" in sys.modules, "argv": sys.argv,
                   "comm": open("/proc/self/comm").read().strip()}, f)
    print("hello from the child", flush=True)
    if os.environ.get("GAAS_TEST_WAIT"):
        signal.pause()
    sys.exit(int(os.environ.get("GAAS_TEST_EXIT", "0")))
