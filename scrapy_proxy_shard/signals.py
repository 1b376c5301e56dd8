"""Signals scrapy-proxy-shard sends through the crawler's signal manager.

Connect like any Scrapy signal::

    crawler.signals.connect(handler, signal=scrapy_proxy_shard.signals.session_rebound)
"""

#: A sticky session's proxy was banned, dead or removed, and the session now uses another proxy.
#: Handlers get ``request``, ``session_id``, ``site`` and ``proxy_id`` (the new proxy's id).
session_rebound = object()

#: ``request`` got a lease (sent once per lease, after any wait). Handlers get ``request``, ``lease``
#: (a :class:`~scrapy_proxy_shard.engine.store.Lease`: ``proxy_id``, ``site``, ``issued_at`` on the
#: Redis clock...) and ``waited`` (seconds spent waiting for it). For tracing and dashboards.
lease_acquired = object()

#: ``request``'s lease went back to the pool. Handlers get ``request``, ``lease``, ``outcome``
#: (``ok``, ``ban``, ``dead``, ``error``, ``unknown``), ``reason`` and ``result`` (a
#: :class:`~scrapy_proxy_shard.engine.store.ReleaseResult`: ``status``, ``now`` on the Redis clock).
#: Not sent when the release itself failed (the lease then expires in Redis).
lease_released = object()

#: A content check that never passed on a site failed for enough distinct proxies: the site's circuit
#: breaker opened with cause ``content`` (sent by the host whose answer opened it). Handlers get
#: ``request``, ``site``, ``pool``, ``check`` (the selectors, as logged) and ``proxies`` (how many failed it).
content_check_suspected = object()
