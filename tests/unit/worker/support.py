"""What the worker's unit tests share: an engine faked behind the Engine interface, and a worker's
generation request."""

import asyncio

from gaas.contracts.finish import LENGTH
from gaas.openai.embeddings import vector_bytes
from gaas.v1 import inference_pb2, worker_pb2
from services.worker.engine import Delta, Embeddings, Engine, EngineInfo, EngineLoad

INFO = EngineInfo("tiny", "1.0", "vllm-cpu", "cpu", 32, 256)


class FakeEngine(Engine):
    info = INFO

    def __init__(self, tokens=3, delay=0.0, fail=None, script=None):
        self.tokens, self.delay, self.fail, self.script = tokens, delay, fail, script
        self.requests = []
        self.aborted = asyncio.Event()

    async def generate(self, r):
        self.requests.append(r)
        if self.fail:
            raise self.fail
        if self.script:
            for d in self.script:
                yield d
            return
        try:
            for i in range(1, self.tokens + 1):
                await asyncio.sleep(self.delay)
                last = i == self.tokens
                yield Delta(
                    text=f"t{i}", token_ids=[i], completion_tokens=i,
                    finish_reason=LENGTH if last else None, done=last,
                    prompt_tokens=5 if last else 0, cached_tokens=2 if last else 0,
                )
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.set()
            raise

    async def embed(self, r):
        """(a model that pools: info's task embed) A vector [input number, its length] per input."""
        if self.info.task != "embed":
            await super().embed(r)  # (refused: its model generates)
        self.requests.append(r)
        return Embeddings([vector_bytes([i, len(x)]) for i, x in enumerate(r.inputs)], sum(map(len, r.inputs)), 1)

    def load(self):
        return EngineLoad(running=len(self.requests), waiting=0, kv_cache_usage=0.25)

    async def shutdown(self):
        pass


def wreq(request_id="req-1", cache_salt="", **kw):
    return worker_pb2.WorkerGenerateRequest(
        request=inference_pb2.GenerateRequest(**kw), request_id=request_id, cache_salt=cache_salt
    )


def write_environ_value(name: str, path: str) -> None:
    """A process target: write the value of environment variable name (or "-") to path."""
    import os

    with open(path, "w") as f:
        f.write(os.environ.get(name, "-"))


def write_titled_cmdline(title: str, path: str) -> None:
    """A process target: set the process's title as vLLM does, write its /proc cmdline to path."""
    import os

    import setproctitle

    setproctitle.setproctitle(title)
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f, open(path, "wb") as out:
        out.write(f.read())


def fork_the_engine_server_and_report(out: str) -> None:
    """Run as a worker started with GAAS_TEST_SERVER_START=server first in its environment: start
    the engine's server as the worker does, change that variable, and write (as JSON to out) this
    process's pid, the server's parent, and what a process started from the server saw."""
    import json
    import os
    from multiprocessing import forkserver

    from services.worker import enginefork

    ctx = enginefork.start_server({"GAAS_TEST_SERVER_START": "server"}, set(), ())
    server = forkserver._forkserver._forkserver_pid
    with open(f"/proc/{server}/stat") as f:
        server_parent = int(f.read().rsplit(")", 1)[1].split()[1])
    os.environ["GAAS_TEST_SERVER_START"] = "starter"
    for target, args in ((write_environ_value, ("GAAS_TEST_SERVER_START", out + ".env")),
                         (write_titled_cmdline, ("VLLM::EngineCore", out + ".cmdline"))):
        p = ctx.Process(target=target, args=args)
        p.start()
        p.join(60)
    with open(out + ".env") as env, open(out + ".cmdline", "rb") as cmdline, open(out, "w") as f:
        json.dump({"pid": os.getpid(), "server_parent": server_parent, "engine_env": env.read(),
                   "engine_cmdline": cmdline.read().decode(errors="replace")}, f)
