"""What the router's unit tests share: the workers, the tokenizer and the control plane faked
behind their interfaces, the router's stages built on them, and a router serving the native API
over a real gRPC server."""

from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from gaas.runtime.server import ServerOptions, ServiceRuntime
from gaas.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.router.auth import Authenticator, Principal
from services.router.directory import MeshDirectory, ModelEntry
from services.router.outcomes import RouterMetrics
from services.router.pipeline import Pipeline
from services.router.scheduling import Candidate, WorkerId, make_scheduler
from services.router.servicer import InferenceServicer
from services.router.stages import Stages

# A tenant's principal as the key checks give it.
ACME = Principal("acme", "gold", "key_1", "salt")
KEYS = {"key-acme": Principal("acme", "gold", "key_1", "salt-acme")}
AUTH = (("authorization", "Bearer key-acme"),)


def rpc_error(code, details="boom"):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeCall:
    """A grpc.aio stream call's read(): the script's chunks, then EOF (or its error)."""

    def __init__(self, script, request):
        self._steps = iter(script)
        self._request = request
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    async def read(self):
        step = next(self._steps, grpc.aio.EOF)
        if callable(step) and not isinstance(step, grpc.aio.AioRpcError):
            step = await step()  # (a step that takes its time)
        if isinstance(step, grpc.aio.AioRpcError):
            raise step
        if hasattr(step, "CopyFrom"):
            # A fresh message each read, as off the wire: the router fills in the chunk it is given
            # (its timings), which must not carry over to the next test reading the same script.
            fresh = type(step)()
            fresh.CopyFrom(step)
            return fresh
        return step


class FakeWorkers:
    """WorkerStub stand-in: each address follows its script (chunks, then maybe an error) on every
    call, or, given an iterator of scripts, the next one on each call."""

    def __init__(self, scripts):
        self.scripts = scripts
        self.calls = []  # (address, request)
        self.tenants = []
        self.made: list[FakeCall] = []

    def Generate(self, request, timeout=None, metadata=()):
        from gaas.runtime.context import current_tenant

        address = dict(metadata)["x-gaas-worker"]
        self.calls.append((address, request))
        self.tenants.append(current_tenant())  # what the channel's interceptor would send on
        script = self.scripts[address]
        call = FakeCall(next(script) if isinstance(script, Iterator) else script, request)
        self.made.append(call)
        return call


def chunk(text, final=False):
    c = common_pb2.GenerateChunk(text=text, token_ids=[1])
    if final:
        c.finish_reason = common_pb2.FINISH_REASON_LENGTH
        c.usage.completion_tokens = 2
    return c


OK = [chunk("a"), chunk("b", final=True)]


class FakeTokenizer:
    """One token per character (the real tokenizer is tested in tests/unit/model/test_tokenizer.py)."""

    vocab_size = 1000

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [1 + ord(c) % 900 for c in text]

    def render_chat(self, messages, add_generation_prompt=True, continue_final_message=False, tools=None):
        return "".join(f"<{m.role}>{m.content}" for m in messages)

    def encode_chat(self, messages, add_generation_prompt=True, continue_final_message=False, add_special_tokens=False, tools=None):
        return self.encode(self.render_chat(messages), add_special_tokens)

    def encode_continuing(self, text, prefix):
        return self.encode(text, False)

    def continued_chars(self, text, prefix):
        return len(text)


async def serve(scripts, workers=("w0", "w1"), retries=2, meter=None, moves=0):
    async def lookup(key):
        return KEYS.get(key)

    fake = FakeWorkers(scripts)
    stages_ = stages(workers, address="{w}", workers_stub=fake, retries=retries, moves=moves)
    servicer = InferenceServicer(Pipeline(stages_, Authenticator(lookup, 2.0), meter))
    rt = ServiceRuntime(ServerOptions(service="t", instance="t", port=0, drain_seconds=0, grace_seconds=1, edge=True))
    rt.add_service(inference_pb2_grpc.add_InferenceServicer_to_server, servicer, "gaas.v1.Inference")
    await rt.start()
    return rt, fake


async def collect(rt, metadata=AUTH, **req):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        return [c async for c in stub.Generate(inference_pb2.GenerateRequest(**req), timeout=5, metadata=metadata)]


def metrics() -> RouterMetrics:
    """The router's metrics on a registry of their own (a test reads them back)."""
    r = CollectorRegistry()
    return RouterMetrics(
        requests=Counter("requests", "", ("model", "tier", "outcome"), registry=r),
        tokens=Counter("tokens", "", ("model", "tier", "kind"), registry=r),
        ttft_seconds=Histogram("ttft", "", ("model", "tier"), registry=r),
        tpot_seconds=Histogram("tpot", "", ("model", "tier"), registry=r),
        latency_seconds=Histogram("latency", "", ("part", "tier"), registry=r),
    )


def stages(workers=("w0",), *, models=None, candidates=None, workers_stub=None, scheduler="round_robin",
           max_model_len=64, address="{w}:1", **kw) -> Stages:
    """The router's stages over a mesh of workers (of model "tiny" 1.0, each at address with its
    name put in, unless candidates are given)."""
    models = models or [ModelEntry("tiny", "1.0", max_model_len, True)]
    cands = candidates or [Candidate(WorkerId(w), address.format(w=w), "tiny", "1.0", max_model_len) for w in workers]

    async def fetch():
        return models, cands

    kw.setdefault("retries", 2)
    kw.setdefault("max_stream_seconds", 30)
    return Stages(MeshDirectory(fetch, 1.0), make_scheduler(scheduler), workers_stub, lambda m: FakeTokenizer(), **kw)
