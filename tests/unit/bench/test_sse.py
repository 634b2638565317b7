"""The load generators' streaming client (bench.common.sse) against a local server that streams as
the ingress does: every `data:` event parsed in order, comments and blank lines skipped, nothing
after `[DONE]`."""

from __future__ import annotations

import socket

from aiohttp import web

from bench.common import sse


async def test_each_data_event_is_parsed_in_order_up_to_done():
    async def answer(request: web.Request) -> web.StreamResponse:
        assert request.headers["authorization"] == "Bearer k-1"
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(request)
        for piece in (b'data: {"n": 1}\n\n', b": a comment\n\n", b'data: {"n": 2}\r\n\r\n',
                      b"data: [DONE]\n\n", b'data: {"n": 3}\n\n'):
            await r.write(piece)
        return r

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    try:
        async with sse.session(f"http://127.0.0.1:{port}", timeout=10) as s:
            async with s.post("/v1/completions", json={}, headers=sse.bearer("k-1")) as r:
                assert [e["n"] async for e in sse.events(r)] == [1, 2]
    finally:
        await runner.cleanup()
