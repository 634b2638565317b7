"""How errors look at the edge: the ingress's Lua filter gives the errors of /v1/ requests OpenAI's
shape (envoy/openai_errors.lua, its tables generated here from gaas.contracts.errors), and the
ingress's own replies (no router answered, a request the transcoder cannot read) get a body that
filter can read."""

from __future__ import annotations

import json
from pathlib import Path

from gaas.settings import router as router_settings

OPENAI_ERRORS_LUA = Path(__file__).resolve().parents[2] / "envoy" / "openai_errors.lua"


def openai_errors_lua() -> str:
    """The ingress's Lua error filter, its tables generated from gaas.contracts.errors.STATUS_TABLE."""
    import grpc

    from gaas.contracts import batches as batch_terms
    from gaas.contracts.errors import HTTP_ONLY_TYPES, STATUS_TABLE

    def lua_table(pairs) -> str:
        return "{" + ", ".join(f'[{k}] = "{v}"' for k, v in pairs) + "}"

    codes = [(grpc.StatusCode[name].value[0], info) for name, info in STATUS_TABLE.items()]
    http_types = {info.http_status: info.openai_type for _, info in codes} | HTTP_ONLY_TYPES
    header = (
        "-- Generated from gaas/contracts/errors.py by gaas/envoy/errors.py.\n"
        f"local GRPC_CODES = {lua_table((c, i.openai_code) for c, i in codes)}\n"
        f"local TYPES = {lua_table((c, i.openai_type) for c, i in codes)}\n"
        f"local HTTP_TYPES = {lua_table(sorted(http_types.items()))}\n"
        f'local MAX_BODY = "{router_settings.max_body_bytes()} bytes"\n'
        f'local MAX_UPLOAD = "{batch_terms.MAX_UPLOAD_BYTES} bytes of file"\n\n'
    )
    return header + OPENAI_ERRORS_LUA.read_text()


def openai_errors_filter() -> dict:
    """The ingress's Lua filter that gives error answers OpenAI's shape (openai_errors_lua)."""
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": openai_errors_lua()},
        },
    }


def router_unanswered_replies() -> dict:
    """local_reply_config of the ingress: the 503 it answers when no router answered a key check
    (ext_authz; its status_on_error) or none is up to serve a request (on the direct path, one
    whose decision call failed) gets a body, in the shape the transcoder gives a router's own
    UNAVAILABLE with a retry delay, so the error filter can give it OpenAI's shape and a
    Retry-After (a reply without a body cannot be given one there). A refusal a router sent is a local reply too, with its own body: untouched."""

    def mapper(details: str, what: str) -> dict:
        body = {"code": 14, "message": f"no router could {what}; retry in a moment",
                "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "router_unavailable"},
                            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retry_delay": "1s"}]}
        return {
            "filter": cel(f"response.code_details.startsWith('{details}')"),
            "body": {"inline_string": json.dumps(body, separators=(",", ":"))},
            "headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        }

    def cel(expression: str) -> dict:
        return {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": expression,
            },
        }}

    # The transcoder's own refusal of what it cannot read (a query parameter of the wrong type) is
    # plain text: in the native API's error shape instead, which the error filter also reads.
    malformed = {
        "filter": cel("response.code == 400 && response.code_details.contains('grpc_json_transcode_failure')"),
        "body_format_override": {"json_format": {"code": 3, "message": "%LOCAL_REPLY_BODY%"}},
    }
    # With no router up, a generation whose decision call failed goes on to the routers' own route
    # (gaas.envoy.direct.ext_proc), which has none to send it to.
    no_router = mapper("no_healthy_upstream", "serve this request")
    no_router["filter"] = cel("response.code_details == 'no_healthy_upstream' && xds.cluster_name == 'router'")
    # An OpenAI request's decision call, asked as its body arrives (gaas.envoy.direct's
    # OPENAI_DECISION_FILTER), cannot fail open once its body went to the call: with no router to
    # reach (the call retried on every one), Envoy's 500 is that same 503.
    no_decision = mapper("ext_proc_error_gRPC_error_14", "serve this request")
    no_decision["status_code"] = 503
    return {"mappers": [mapper("ext_authz_error", "check this request's API key"), no_router, no_decision,
                        malformed]}
