import pytest

from gaas.runtime import redisconn


@pytest.fixture
async def redis(redis_url):
    """A client of the session's throw-away Redis."""
    client = redisconn.connect(redis_url)
    yield client
    await client.aclose()
