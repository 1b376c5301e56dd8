"""Scrapy add-on: ``ADDONS = {"scrapy_proxy_shard.addon.ProxyShardAddon": 0}`` enables the middlewares.

It adds the lease, ban-detection and guard middlewares to ``DOWNLOADER_MIDDLEWARES`` *whatever the
priority of that setting* (a project's settings.py, a spider's ``custom_settings``), through
Scrapy's ``setdefault_in_component_priority_dict`` (Scrapy >= 2.13): an entry the user wrote for
one of them, even ``None`` to disable it, wins. Setting the whole dict at add-on priority instead
would lose to any project-level ``DOWNLOADER_MIDDLEWARES`` and silently load nothing.
"""

from __future__ import annotations

from typing import Any

from scrapy.utils.misc import load_object

from scrapy_proxy_shard.crawl.wiring import BAN_MIDDLEWARE, GUARD_MIDDLEWARE, LEASE_MIDDLEWARE, PRIORITIES

__all__ = ["BAN_MIDDLEWARE", "GUARD_MIDDLEWARE", "LEASE_MIDDLEWARE", "PRIORITIES", "ProxyShardAddon"]


class ProxyShardAddon:
    """Insert the plugin's downloader middlewares at their default orders unless already listed."""

    def update_settings(self, settings: Any) -> None:
        for path, priority in PRIORITIES.items():
            settings.setdefault_in_component_priority_dict("DOWNLOADER_MIDDLEWARES", load_object(path), priority)
