"""Signals scrapy-proxy-shard sends through the crawler's signal manager.

Connect like any Scrapy signal::

    crawler.signals.connect(handler, signal=scrapy_proxy_shard.signals.session_rebound)
"""

#: A sticky session's proxy was banned, dead or removed, and the session now uses another proxy.
#: Handlers get ``request``, ``session_id``, ``site`` and ``proxy_id`` (the new proxy's id).
session_rebound = object()
