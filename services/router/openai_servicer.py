"""gaas.v1.OpenAI: OpenAI's /v1/models, /v1/completions and /v1/chat/completions over HttpBody
methods behind the ingress's transcoder. Errors before the first byte are gRPC statuses (the
ingress turns them into HTTP statuses and OpenAI's error shape); after it, an SSE error event."""

from __future__ import annotations

import time

import grpc
from google.api import httpbody_pb2

from gaas.runtime.context import current_request_id
from gaas.v1 import openai_pb2_grpc
from services.router import openai_api
from services.router.auth import Authenticator
from services.router.dispatch import Dispatcher, DispatchError
from services.router.servicer import admit

JSON = "application/json"
SSE = "text/event-stream"


class OpenAIServicer(openai_pb2_grpc.OpenAIServicer):
    def __init__(self, dispatcher: Dispatcher, authenticator: Authenticator, max_body_bytes: int) -> None:
        self._dispatcher = dispatcher
        self._auth = authenticator
        self._max_body = max_body_bytes

    async def ListModels(self, request, context) -> httpbody_pb2.HttpBody:
        await admit(context, self._auth)
        try:
            models = await self._dispatcher.models()
        except DispatchError as exc:
            await context.abort(exc.code, exc.message)
        listed = [(m.name, n, m.max_model_len) for m, n in models]
        return httpbody_pb2.HttpBody(content_type=JSON, data=openai_api.dumps(openai_api.models_list(listed)))

    async def Completions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, "completion"):
            yield body

    async def ChatCompletions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, "chat"):
            yield body

    async def _serve(self, http: httpbody_pb2.HttpBody, context, kind: str):
        arrived = time.perf_counter()
        principal = await admit(context, self._auth)
        request_id = current_request_id()
        try:
            body = openai_api.parse_json(http.data, self._max_body)
            parsed = openai_api.parse_chat(body) if kind == "chat" else openai_api.parse_completion(body)
        except openai_api.BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        fmt = openai_api.Formatter(kind, request_id, parsed.generate.model)
        chunks = self._dispatcher.stream(parsed.generate, principal, request_id, context.time_remaining(), arrived)

        if not parsed.stream:
            text: list[str] = []
            final = None
            try:
                async for c in chunks:
                    text.append(c.text)
                    if c.finish_reason:
                        final = c
            except DispatchError as exc:
                await context.abort(exc.code, exc.message)
            yield httpbody_pb2.HttpBody(content_type=JSON, data=openai_api.dumps(fmt.response("".join(text), final)))
            return

        started = False
        final = None
        try:
            async for c in chunks:
                finish = openai_api.finish_reason(c) if c.finish_reason else None
                if c.finish_reason:
                    final = c
                # One event per engine step, even when its text is empty (a character still being
                # completed byte by byte): clients see the pace of generation as it is.
                piece = fmt.chunk(c.text, finish, parsed.include_usage, first=not started)
                yield httpbody_pb2.HttpBody(content_type=SSE, data=openai_api.sse(piece))
                started = True
        except DispatchError as exc:
            if not started:
                await context.abort(exc.code, exc.message)
            yield httpbody_pb2.HttpBody(content_type=SSE, data=openai_api.error_event(exc.code.name, exc.message))
            return
        if parsed.include_usage and final is not None:
            yield httpbody_pb2.HttpBody(content_type=SSE, data=openai_api.sse(fmt.usage_chunk(final)))
        yield httpbody_pb2.HttpBody(content_type=SSE, data=openai_api.DONE)
