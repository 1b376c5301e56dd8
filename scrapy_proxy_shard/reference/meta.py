"""The ``Request.meta`` keys the plugin reads or sets: the text of the meta keys reference page.

tests/test_stats_reference.py checks that every key here is a string the package uses, and that every
public ``proxy_shard*`` key the package reads from a request's meta is here. README.md's short table
names the keys you set (checked there too).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetaDoc:
    """One key: its name, who sets it (you or the plugin), what it means."""

    key: str
    set_by: str
    meaning: str


YOU, PLUGIN = "you", "the plugin"

META_KEYS: tuple[MetaDoc, ...] = (
    MetaDoc("proxy_pool", YOU, "pool for this request (before the spider's `proxy_pool`, "
            "`PROXY_SHARD_SITE_POOLS` and `PROXY_SHARD_POOL`); an unknown or empty pool fails that request "
            "with one ERROR line (`RequestNotLeased`, stat `proxy_shard/pool_errors`)"),
    MetaDoc("session_id", YOU, "sticky proxy for this session on this site: a string of 1-200 printable "
            "characters (not only spaces) or an int (`7` and `\"7\"` are one session); anything else "
            "(`False`, a dict, a float, a 1 MB string) fails that request with `InvalidSessionId` to its "
            "errback (ERROR line, stat `proxy_shard/invalid_session_id`) instead of becoming a shared session "
            "named `\"False\"`"),
    MetaDoc("proxy_shard_end_session", YOU, "`True`: end the session after this response (its proxy is free "
            "at once)"),
    MetaDoc("proxy_shard", YOU, "`False`: do not lease for this request. With no `meta['proxy']` of your own "
            "it goes out from the host's own IP: refused (`RequestNotLeased`) unless "
            "`PROXY_SHARD_ALLOW_DIRECT`, then counted `proxy_shard/direct` and logged at WARNING. A non-empty "
            "`meta['proxy']` you set yourself is also left alone; `None` or `\"\"` is no proxy: the request is "
            "leased ([download handlers](../failure-model.md#download-handlers))"),
    MetaDoc("proxy_shard_skip", YOU, "older spelling of `proxy_shard: False`, still honoured"),
    MetaDoc("proxy_shard_required_css", YOU, "CSS selectors this response must match, or it is a ban "
            "(overrides the spider attribute `proxy_shard_required_css` and per-site rules)"),
    MetaDoc("proxy_shard_max_ban_retries", YOU, "ban retry budget for this request (default "
            "`PROXY_SHARD_BAN_RETRIES`)"),
    MetaDoc("proxy_shard_ban_retries", PLUGIN, "retries done so far"),
    MetaDoc("proxy_shard_proxy_id", PLUGIN, "id of the proxy used (for your items and logs; never its URL)"),
    MetaDoc("proxy", PLUGIN, "the leased proxy's URL, as Scrapy's `HttpProxyMiddleware` expects it (set by "
            "you instead: the request is left alone)"),
    MetaDoc("download_slot", PLUGIN, "`<site>|<proxy id>`: each leased request gets a download slot of its "
            "own ([download slots](../guide/enabling.md#download-slots))"),
    MetaDoc("playwright_context", PLUGIN, "for a scrapy-playwright request (`meta['playwright']`): the browser "
            "context bound to the leased proxy, `proxy-shard:<proxy id>:<url hash>`; a context of your own "
            "fails the request ([scrapy-playwright](../recipes/scrapy-playwright.md))"),
    MetaDoc("playwright_context_kwargs", PLUGIN, "for that context: Playwright's `proxy` option (server, "
            "username, password); a `proxy` of your own here fails the request"),
    MetaDoc("impersonate_curl_options", PLUGIN, "for a scrapy-impersonate request (`meta['impersonate']`): "
            "`NOPROXY` set to `\"\"`, so `no_proxy` in the environment cannot send it around the leased proxy "
            "(your other options stay); a proxy option of your own here (`PROXY`, `NOPROXY`, `PRE_PROXY`...), "
            "or `proxy`/`proxies`/`proxy_auth` in `impersonate_args`, fails the request "
            "([scrapy-impersonate](../recipes/scrapy-impersonate.md))"),
)
