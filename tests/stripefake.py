"""A small local server that follows Stripe's documented meter-event contract, for tests (and
`python -m tests.stripefake` by hand): POST /v1/billing/meter_events, form-encoded, bearer auth,
required fields, the 35-day / 5-minute timestamp bounds, identifiers deduplicated; GET
/v1/billing/meters and /v1/billing/meters/{id}/event_summaries (minute-aligned bounds); and failures
on demand (429 / 5xx for a while, or events taken while the answer is lost). No Stripe fake on PyPI implements meter events; the
real `stripe` SDK is pointed here with base_addresses={"api": url}."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs


class FakeStripe:
    def __init__(self, api_key: str = "sk_test_gaas", meters: tuple[str, ...] = ()) -> None:
        self.api_key = api_key
        self.meters = set(meters)
        self.events: dict[str, dict] = {}  # identifier -> event
        self.requests = 0
        self.duplicates = 0
        self._fail_until = 0.0
        self._fail_status = 500
        self._fail_count = 0
        self._lose_count = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Request-Id", f"req_fake_{fake.requests}")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                path, _, query = self.path.partition("?")
                params = {k: v[0] for k, v in parse_qs(query).items()}
                status, body = fake.handle_get(path, self.headers.get("Authorization", ""), params)
                self._answer(status, body)

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
                status, body = fake.handle(self.path, self.headers.get("Authorization", ""), form)
                self._answer(status, body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> "FakeStripe":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fail_for(self, seconds: float, status: int = 500) -> None:
        """Answer every request with status (429 or 5xx) for a while."""
        with self._lock:
            self._fail_until, self._fail_status = time.monotonic() + seconds, status

    def fail_next(self, count: int, status: int = 500) -> None:
        with self._lock:
            self._fail_count, self._fail_status = count, status

    def lose_answers(self, count: int) -> None:
        """Take the next count events but answer 500 (the answer lost on the way back)."""
        with self._lock:
            self._lose_count = count

    def totals(self) -> dict[tuple[str, str], int]:
        """(customer, event name) -> the sum of accepted values."""
        out: dict[tuple[str, str], int] = {}
        with self._lock:
            for e in self.events.values():
                key = (e["payload"]["stripe_customer_id"], e["event_name"])
                out[key] = out.get(key, 0) + int(e["payload"]["value"])
        return out

    @staticmethod
    def _error(status: int, kind: str, message: str, code: str = "", param: str = "") -> tuple[int, dict]:
        err = {"type": kind, "message": message}
        if code:
            err["code"] = code
        if param:
            err["param"] = param
        return status, {"error": err}

    def _refusal(self, authorization: str) -> tuple[int, dict] | None:
        """A failure on demand, or a wrong key (call with the lock held)."""
        self.requests += 1
        if self._fail_count > 0 or time.monotonic() < self._fail_until:
            self._fail_count = max(0, self._fail_count - 1)
            if self._fail_status == 429:
                return self._error(429, "invalid_request_error", "Too many requests", "rate_limit")
            return self._error(self._fail_status, "api_error", "Something went wrong on Stripe's end")
        if authorization != f"Bearer {self.api_key}":
            return self._error(401, "invalid_request_error", "Invalid API Key provided")
        return None

    def _meter_names(self) -> list[str]:
        return sorted(self.meters | {e["event_name"] for e in self.events.values()})

    def handle_get(self, path: str, authorization: str, params: dict) -> tuple[int, dict]:
        with self._lock:
            if refused := self._refusal(authorization):
                return refused
            if path == "/v1/billing/meters":
                meters = [{"object": "billing.meter", "id": f"mtr_{name}", "event_name": name, "status": "active"}
                          for name in self._meter_names()]
                return 200, {"object": "list", "url": path, "has_more": False, "data": meters}
            parts = path.strip("/").split("/")
            if len(parts) == 5 and parts[:3] == ["v1", "billing", "meters"] and parts[4] == "event_summaries":
                name = parts[3].removeprefix("mtr_")
                if name not in self._meter_names():
                    return self._error(404, "invalid_request_error", f"No such billing meter: '{parts[3]}'",
                                       "resource_missing", "id")
                for p in ("customer", "start_time", "end_time"):
                    if not params.get(p):
                        return self._error(400, "invalid_request_error", f"Missing required param: {p}.",
                                           "parameter_missing", p)
                start, end = int(params["start_time"]), int(params["end_time"])
                if start % 60 or end % 60:
                    return self._error(400, "invalid_request_error", "start_time and end_time must be aligned with "
                                       "minute boundaries", "parameter_invalid_integer", "start_time")
                value = sum(int(e["payload"]["value"]) for e in self.events.values()
                            if e["event_name"] == name and e["payload"]["stripe_customer_id"] == params["customer"]
                            and start <= e["timestamp"] < end)
                summary = {"object": "billing.meter_event_summary", "id": f"mtrusum_{name}_{start}",
                           "aggregated_value": value, "start_time": start, "end_time": end, "meter": parts[3],
                           "livemode": False}
                return 200, {"object": "list", "url": path, "has_more": False, "data": [summary]}
            return self._error(404, "invalid_request_error", f"Unrecognized request URL (GET: {path})")

    def handle(self, path: str, authorization: str, form: dict) -> tuple[int, dict]:
        with self._lock:
            if refused := self._refusal(authorization):
                return refused
            if path != "/v1/billing/meter_events":
                return self._error(404, "invalid_request_error", f"Unrecognized request URL (POST: {path})")
            for name in ("event_name", "payload[stripe_customer_id]", "payload[value]"):
                if not form.get(name):
                    return self._error(400, "invalid_request_error", f"Missing required param: {name}.",
                                       "parameter_missing", name)
            if self.meters and form["event_name"] not in self.meters:
                return self._error(400, "invalid_request_error", f"No active meter found for event name "
                                   f"'{form['event_name']}'", "resource_missing", "event_name")
            now = int(time.time())
            ts = int(form.get("timestamp") or now)
            if ts < now - 35 * 86400 or ts > now + 300:
                return self._error(400, "invalid_request_error", "Timestamp must be within the past 35 calendar days "
                                   "and no more than 5 minutes in the future", "parameter_invalid_integer", "timestamp")
            ident = form.get("identifier") or f"auto_{self.requests}"
            if ident in self.events:
                self.duplicates += 1
                return self._error(400, "invalid_request_error", f"An event already exists with identifier {ident}.",
                                   "resource_already_exists", "identifier")
            event = {
                "object": "billing.meter_event", "event_name": form["event_name"], "identifier": ident,
                "payload": {"stripe_customer_id": form["payload[stripe_customer_id]"], "value": form["payload[value]"]},
                "timestamp": ts, "created": now, "livemode": False,
            }
            self.events[ident] = event
            if self._lose_count > 0:
                self._lose_count -= 1
                return self._error(500, "api_error", "Something went wrong on Stripe's end")
            return 200, event


if __name__ == "__main__":
    fake = FakeStripe(sys.argv[1] if len(sys.argv) > 1 else "sk_test_gaas").start()
    print(f"fake Stripe at {fake.url} (key {fake.api_key}); Ctrl-C stops it", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        fake.stop()
