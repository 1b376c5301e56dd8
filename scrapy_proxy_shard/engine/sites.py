"""Which *site* a request belongs to: the key anti-bot systems count by.

By default a site is the registrable domain of the request URL (``shop.example.co.uk`` →
``example.co.uk``), from the Public Suffix List snapshot bundled with tldextract (never fetched at run
time). A site may be mapped to a *site group* — sites that share one blacklist — so one IP is never
seen on two of them at once and a ban on one counts for all: groups declared
(``PROXY_SHARD_SITE_GROUPS``), then groups learned from bans (``SiteMap.learn``). The lease engine only
ever sees the resulting key.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from urllib.parse import urlsplit

import tldextract

from scrapy_proxy_shard.exceptions import SettingError

#: Host names whose key SiteMap keeps (a broad crawl sees more: the cache is simply started again).
HOST_CACHE = 4096
_extract = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)
#: A site key (registrable domain, IP or site group): it is part of Redis keys and ban scopes, so it
#: starts with a letter or digit (``*`` is the proxy-wide ban scope and never a site) and has no
#: space, ``|`` or control character.
SITE_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-\[\]:]{0,252}")


@lru_cache(maxsize=4096)
def registrable_domain(host: str) -> str:
    """The registrable domain of a host name, or the host itself for IPs and single labels.

    Raises ValueError for what cannot be a site key (empty, ``*``, spaces...): a site named ``*``
    would be the proxy-wide quarantine scope.
    """
    host = host.strip().lower().rstrip(".")
    if not host:
        raise ValueError("empty host")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return host
    except ValueError:
        pass
    ext = _extract(host)
    # An unknown suffix (e.g. *.test, *.internal): the last two labels.
    site = f"{ext.domain}.{ext.suffix}" if ext.suffix and ext.domain else ".".join(host.split(".")[-2:])
    if not SITE_KEY_RE.fullmatch(site):
        raise ValueError(f"{host!r} is not a site (a domain such as shop.com; '*' means every site)")
    return site


def check_site(value: object, source: str) -> str:
    """A site given by a user (setting key, CLI option) as its site key, or SettingError naming ``source``.

    Names with a dot are domains (``www.shop.co.uk`` counts as ``shop.co.uk``); names without one are
    kept as given (a site group, a single-label host).
    """
    text = value.strip().lower() if isinstance(value, str) else None
    try:
        if not text:
            raise ValueError("empty")
        return registrable_domain(text) if "." in text else _plain_key(text)
    except ValueError:
        raise SettingError(f"{source}: invalid site {value!r}: use a domain such as shop.com or a site group "
                           "name (letters, digits, '.', '_', '-'; '*' is reserved for proxy-wide)") from None


def _plain_key(text: str) -> str:
    if not SITE_KEY_RE.fullmatch(text):
        raise ValueError(text)
    return text


def site_of_url(url: str) -> str:
    """Registrable domain of a URL's host."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"URL has no host: {url!r}")
    return registrable_domain(host)


def site_of_request(request) -> str:
    """Registrable domain of a request's host (any object with a ``url``: the engine knows no Scrapy)."""
    return site_of_url(request.url)


class SiteMap:
    """Maps a request URL to its exclusivity key: the site, or the site group it belongs to."""

    def __init__(self, groups: Mapping[str, Iterable[str]] | None = None) -> None:
        self._group_of: dict[str, str] = {}
        self._by_host: dict[str, str] = {}  # host name -> key: every request asks, most of one host
        self._learned_of: dict[str, dict[str, str]] = {}  # pool -> its learned groups (SiteMap.learn)
        self._learned: dict[str, str] = {}  # every pool's, one map: key -> its learned group's key
        for group, members in (groups or {}).items():
            if not isinstance(group, str) or not SITE_KEY_RE.fullmatch(group):
                raise SettingError(
                    f"PROXY_SHARD_SITE_GROUPS: invalid group name {group!r} "
                    "(letters, digits, '.', '_' and '-')"
                )
            if isinstance(members, str):
                members = [members]
            for member in members:
                site = check_site(member, f"PROXY_SHARD_SITE_GROUPS[{group!r}]")
                previous = self._group_of.setdefault(site, group)
                if previous != group:
                    raise SettingError(
                        f"PROXY_SHARD_SITE_GROUPS: site {site!r} is in two groups "
                        f"({previous!r} and {group!r})"
                    )

    def _key(self, site: str) -> str:
        key = self._group_of.get(site, site)
        return self._learned.get(key, key) if self._learned else key

    def key_for_site(self, site: str) -> str:
        return self._key(registrable_domain(site))

    def key_for_url(self, url: str) -> str:
        return self._key(site_of_url(url))

    def key_for_host(self, host: str) -> str:
        """The key of a host name as a parsed URL gives it (lower case): one dict lookup once seen."""
        key = self._by_host.get(host)
        if key is None:
            key = self._key(registrable_domain(host))
            if len(self._by_host) >= HOST_CACHE:
                self._by_host.clear()
            self._by_host[host] = key
        return key

    def key_for_request(self, request) -> str:
        return self._key(site_of_request(request))

    def learn(self, pool: str, groups: Mapping[str, str]) -> bool:
        """Take ``pool``'s learned site groups (site key -> group key, as Redis keeps them: see
        ``engine/store_links.py``). The groups of every pool apply to every request (a shared blacklist is
        the sites', not a pool's): two pools' groups that share a site are one group, keyed by its least
        key. Returns True when the keys changed."""
        self._learned_of[pool] = dict(groups)
        parent: dict[str, str] = {}

        def root(key: str) -> str:
            while parent.get(key, key) != key:
                key = parent[key]
            return key

        for mapping in self._learned_of.values():
            for site, group in mapping.items():
                a, b = root(site), root(group)
                if a != b:
                    parent[max(a, b)] = min(a, b)
        learned = {key: root(key) for key in parent}
        if learned == self._learned:
            return False
        self._learned = learned
        self._by_host.clear()
        return True

    def regroup(self, key: str) -> str:
        """The key a request keyed ``key`` before the last ``learn`` leases under now."""
        return self._learned.get(key, key) if self._learned else key

    def learned(self) -> dict[str, str]:
        """Learned site groups in force: site key -> group key."""
        return dict(self._learned)

    def groups(self) -> dict[str, str]:
        return dict(self._group_of)
