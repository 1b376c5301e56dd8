"""Issue 21: every line naming where an in-process engine runs says so, never a fakeredis address.

The embedded, static and fallback engines run on an in-memory fakeredis server whose address
(``redis://<hex>:6379/0``) used to appear in "loaded ... Functions library ... into Redis at ...":
read as a Redis server, i.e. as if other hosts shared the pool. Redis mode still names its URL, masked.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis

from scrapy_proxy_shard.engine.store import AsyncPoolStore
from scrapy_proxy_shard.exceptions import PoolUnreachable
from scrapy_proxy_shard.modes.process import shared_engine


@pytest.mark.parametrize("kind", ["embedded", "static", "fallback"])
def test_in_process_engine_lines_say_in_process(kind, caplog):
    caplog.set_level(logging.INFO, logger="scrapy_proxy_shard")

    async def go():
        store = shared_engine(kind, namespace=f"labels_{kind}", host_id="h1")
        try:
            assert "in-process, " in store.where and "not shared with other hosts" in store.where
            await store.add_proxies("p", ["http://u:Secr3t@10.0.0.1:3128"])
            lease = await store.lease("p", "shop.com", ttl=30)
            assert lease is not None
            error = store._backend_error(redis.ConnectionError("gone"))
            assert isinstance(error, PoolUnreachable)
            assert str(error).startswith("cannot reach the ") and f"{kind} engine (in-process, " in str(error)
        finally:
            await store.aclose()

    asyncio.run(go())
    assert "redis://" not in caplog.text and "Redis at" not in caplog.text
    # fakeredis loads the library (FUNCTION LOAD) or, before it had Functions (< 2.3x), answers FCALL with
    # "unknown command": either way the one line about Functions names the in-process engine.
    lines = [r.getMessage() for r in caplog.records if "Functions" in r.getMessage()]
    assert len(lines) == 1 and f"{kind} engine (in-process, " in lines[0], caplog.text
    assert "not shared with other hosts)" in lines[0]
    assert "Secr3t" not in caplog.text


def test_redis_mode_names_the_masked_url():
    import fakeredis

    store = AsyncPoolStore(fakeredis.FakeAsyncRedis(), url_for_errors="redis://user:pw@redis.internal:6379/0")
    assert store.where == "redis://***:***@redis.internal:6379/0"
    error = store._backend_error(redis.ConnectionError("refused"))
    assert str(error) == "cannot reach Redis at redis://***:***@redis.internal:6379/0: refused"
