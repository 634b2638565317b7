"""`gaas top`'s frame (gaas/cli/top.py): the Redis memory each tenant holds in stored responses and
sessions is drawn against its cap, the most first; a Redis that could not be read says so; a frame
read without it draws no such section."""

from gaas.cli import top

HEALTH = {"instances": [], "workers": [], "ingress": "127.0.0.1:8080", "ingress_ready": True}


def test_the_redis_each_tenant_holds_is_drawn_against_its_cap_the_most_first():
    stored = [{"tenant": "mallory", "bytes": 36 * 2**20, "cap": 48 * 2**20},
              {"tenant": "alice", "bytes": 2**20, "cap": 48 * 2**20}]
    text = top.frame({**HEALTH, "stored": stored}, [], now=0, tenants_shown=1)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("REDIS HELD BY"))
    assert lines[at + 1].startswith("mallory") and "75%" in lines[at + 1]
    assert "36.0 MiB" in lines[at + 1] and "48.0 MiB" in lines[at + 1]
    assert lines[at + 2] == "... and 1 more"


def test_a_redis_that_could_not_be_read_says_so_and_none_read_draws_nothing():
    assert "(Redis could not be read)" in top.frame({**HEALTH, "stored": None}, [], now=0)
    assert "(no tenant holds stored responses or sessions)" in top.frame({**HEALTH, "stored": []}, [], now=0)
    assert "REDIS HELD BY" not in top.frame(HEALTH, [], now=0)
