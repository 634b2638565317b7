"""The bytes a tenant may hold in Redis (gaas/contracts/tenantbytes.py): the default cap is at most 5%
of the memory the mesh gives its Redis, Redis's memory sizes read as redis.conf reads them, and the
cap read from the deployment file's sessions section."""

import pytest

from gaas.contracts import tenantbytes
from gaas.contracts.sessions import parse_policy
from gaas.ops import redisacl


def test_the_default_cap_is_at_most_5_percent_of_the_redis_the_mesh_starts():
    assert parse_policy(None).max_bytes_per_tenant == tenantbytes.DEFAULT_MAX_BYTES
    assert tenantbytes.DEFAULT_MAX_BYTES <= 0.05 * tenantbytes.memory_bytes(redisacl.MAXMEMORY)


@pytest.mark.parametrize("text, expected", [("1gb", 2**30), ("512mb", 512 * 2**20), ("1g", 10**9), ("100000", 100000),
                                            ("64KB", 65536)])
def test_a_redis_memory_size_reads_as_redis_reads_it(text, expected):
    assert tenantbytes.memory_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "1tb", "one gb", "-1gb"])
def test_what_is_not_a_redis_memory_size_is_refused(text):
    with pytest.raises(ValueError):
        tenantbytes.memory_bytes(text)


def test_the_cap_is_read_from_the_sessions_section_and_must_be_a_positive_whole_number():
    assert parse_policy({"max_bytes_per_tenant": 1000}).max_bytes_per_tenant == 1000
    for bad in (0, "1gb", 1.5, True):
        with pytest.raises(ValueError, match="sessions.max_bytes_per_tenant"):
            parse_policy({"max_bytes_per_tenant": bad})
