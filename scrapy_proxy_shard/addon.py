"""Scrapy add-on: ``ADDONS = {"scrapy_proxy_shard.addon.ProxyShardAddon": 0}`` enables both middlewares.

An alternative to editing ``DOWNLOADER_MIDDLEWARES`` by hand; explicit entries there win.
"""

from __future__ import annotations

from typing import Any

LEASE_MIDDLEWARE = "scrapy_proxy_shard.middlewares.ProxyShardMiddleware"
BAN_MIDDLEWARE = "scrapy_proxy_shard.middlewares.BanDetectionMiddleware"
#: Before HttpProxyMiddleware (750), which turns URL credentials into Proxy-Authorization; the ban
#: detector's process_response runs before Redirect (600), HttpCompression (590) and Retry (550).
PRIORITIES = {LEASE_MIDDLEWARE: 610, BAN_MIDDLEWARE: 620}


class ProxyShardAddon:
    """Insert the lease and ban-detection middlewares at their default priorities."""

    def update_settings(self, settings: Any) -> None:
        middlewares = settings.getdict("DOWNLOADER_MIDDLEWARES")
        for path, priority in PRIORITIES.items():
            middlewares.setdefault(path, priority)
        settings.set("DOWNLOADER_MIDDLEWARES", middlewares, priority="addon")
