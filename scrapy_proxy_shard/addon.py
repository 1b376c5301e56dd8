"""Scrapy add-on: ``ADDONS = {"scrapy_proxy_shard.addon.ProxyShardAddon": 0}`` enables the middlewares.

It adds the lease, ban-detection and guard middlewares to ``DOWNLOADER_MIDDLEWARES`` *whatever the
priority of that setting* (a project's settings.py, a spider's ``custom_settings``), through
Scrapy's ``setdefault_in_component_priority_dict`` (Scrapy >= 2.13): an entry the user wrote for
one of them, even ``None`` to disable it, wins. Setting the whole dict at add-on priority instead
would lose to any project-level ``DOWNLOADER_MIDDLEWARES`` and silently load nothing.

It also makes ``SiteAwarePriorityQueue`` (``crawl/scheduling.py``) the scheduler's priority queue, so
requests waiting for a lease on a throttled site (its pace, quarantines, an open breaker) do not take
every concurrency slot from the other sites; unless the project chose a priority queue itself, sets
``CONCURRENT_REQUESTS_PER_IP`` (which that queue refuses, as Scrapy's ``DownloaderAwarePriorityQueue``
does) or runs with a ``JOBDIR`` (Scrapy resumes a crawl only with the queue it started with).
"""

from __future__ import annotations

import logging
from typing import Any

from scrapy.settings import SETTINGS_PRIORITIES
from scrapy.utils.misc import load_object

from scrapy_proxy_shard.crawl.wiring import BAN_MIDDLEWARE, GUARD_MIDDLEWARE, LEASE_MIDDLEWARE, PRIORITIES

logger = logging.getLogger(__name__)

__all__ = ["BAN_MIDDLEWARE", "GUARD_MIDDLEWARE", "LEASE_MIDDLEWARE", "PRIORITIES", "SITE_AWARE_QUEUE",
           "ProxyShardAddon"]

SITE_AWARE_QUEUE = "scrapy_proxy_shard.crawl.scheduling.SiteAwarePriorityQueue"


class ProxyShardAddon:
    """Insert the plugin's downloader middlewares at their default orders unless already listed."""

    def update_settings(self, settings: Any) -> None:
        for path, priority in PRIORITIES.items():
            cls = load_object(path)
            try:
                settings.setdefault_in_component_priority_dict("DOWNLOADER_MIDDLEWARES", cls, priority)
            except (ImportError, NameError, AttributeError, ValueError, TypeError):
                # Scrapy loads every entry to compare it with ours: one of the project's cannot be
                # loaded (a typo). Say which, once, then add ours by name: Scrapy refuses that entry
                # itself when it builds the middlewares.
                _name_unloadable(settings)
                _setdefault_by_name(settings, path, cls, priority)
        _default_queue(settings)


def _default_queue(settings: Any) -> None:
    """``SiteAwarePriorityQueue`` where the project left Scrapy's queue, no JOBDIR, no per-IP limit."""
    default = SETTINGS_PRIORITIES["default"]
    if settings.getpriority("SCHEDULER_PRIORITY_QUEUE") > default or settings.get("JOBDIR"):
        return
    per_ip = settings.getpriority("CONCURRENT_REQUESTS_PER_IP")  # deprecated: read only when set
    if per_ip is not None and per_ip > default and settings.getint("CONCURRENT_REQUESTS_PER_IP"):
        return
    settings.set("SCHEDULER_PRIORITY_QUEUE", SITE_AWARE_QUEUE, "addon")


def _name_unloadable(settings: Any) -> None:
    for entry in settings.getdict("DOWNLOADER_MIDDLEWARES"):
        if not isinstance(entry, str):
            continue
        try:
            load_object(entry)
        except (ImportError, NameError, AttributeError, ValueError, TypeError) as exc:
            if entry not in _NAMED:
                _NAMED.add(entry)
                logger.error("proxy_shard: DOWNLOADER_MIDDLEWARES names %(entry)r, which cannot be loaded "
                             "(%(e)s): fix its path or remove it", {"entry": entry, "e": exc})


_NAMED: set[str] = set()  # entries already reported (the add-on runs once per crawler)


def _setdefault_by_name(settings: Any, path: str, cls: type, priority: int) -> None:
    """``setdefault_in_component_priority_dict`` without loading the other entries: ours is listed
    already when an entry names it (its path, or the class itself)."""
    components = settings.getdict("DOWNLOADER_MIDDLEWARES")
    if any(entry == path or entry is cls for entry in components):
        return
    components[cls] = priority
    settings.set("DOWNLOADER_MIDDLEWARES", components, settings.getpriority("DOWNLOADER_MIDDLEWARES"))
