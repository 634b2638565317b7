"""bench.startup: a worker's starts read from its log, each split into the steps it tells."""

import time
from datetime import datetime, timezone

from bench.startup import worker_starts


def header_at(utc: str) -> str:
    """The launcher's header time (local) of a UTC moment."""
    at = datetime.fromisoformat(utc).replace(tzinfo=timezone.utc).timestamp()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def test_each_start_in_a_worker_log_is_timed_from_its_header(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text(
        f"\n=== {header_at('2026-12-07T09:02:59')} /venv/bin/python -m services.worker.server\n"
        '{"ts": "2026-12-07T09:03:00.500Z", "msg": "worker-0 listening on unix:/s (NOT_SERVING until ready)"}\n'
        "(EngineCore pid=1) INFO a line of vLLM's own\n"
        '{"ts": "2026-12-07T09:03:10.000Z", "msg": "engine up in 4.6 s: gaas-tiny on cpu"}\n'
        '{"ts": "2026-12-07T09:03:11.200Z", "msg": "health: SERVING"}\n'
        f"\n=== {header_at('2026-12-07T09:05:00')} restart 1: /venv/bin/python -m services.worker.server\n"
        '{"ts": "2026-12-07T09:05:01.000Z", "msg": "worker-0 listening on unix:/s (NOT_SERVING until ready)"}\n'
    )
    assert worker_starts(log) == [{"listening_s": 1.5, "engine_up_s": 11.0, "serving_s": 12.2}, {"listening_s": 1.0}]
