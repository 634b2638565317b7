import os
import signal
import subprocess

import pytest

from gaas.launcher.secrets import redis_answers, redis_server_command
from gaas.runtime import redisconn
from tests.conftest import free_port
from tests.waiting import eventually


@pytest.fixture
async def redis(redis_url):
    """A client of the session's throw-away Redis."""
    client = redisconn.connect(redis_url)
    yield client
    await client.aclose()


class RedisProcess:
    """A Redis of one test's own, that the test kills (-9, as an operator's soak does) and starts
    again on the same port, empty (nothing is saved)."""

    def __init__(self, data_dir) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._data_dir = data_dir
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> None:
        self._proc = subprocess.Popen(redis_server_command("127.0.0.1", self.port, self._data_dir),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            eventually(lambda: redis_answers(self.url, timeout=0.2) or self._proc.poll() is not None, timeout,
                       every=0.02, what="redis-server answering")
        except pytest.fail.Exception:
            self.kill()
            raise
        if self._proc.poll() is not None:
            pytest.fail(f"redis-server exited with {self._proc.returncode} as it started")

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)
        self._proc = None


@pytest.fixture
def redis_process(tmp_path):
    """A Redis of the test's own (RedisProcess), started."""
    process = RedisProcess(tmp_path / "redis")
    process.start()
    yield process
    process.kill()
