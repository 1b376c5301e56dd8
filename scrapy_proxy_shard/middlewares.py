"""The downloader middlewares: thin wiring between Scrapy and the runtime/policy.

``ProxyShardMiddleware`` (610, before ``HttpProxyMiddleware`` at 750, which turns URL credentials
into ``Proxy-Authorization``) leases a proxy slot for every request and releases it with the
outcome. ``BanDetectionMiddleware`` (620: its ``process_response`` runs before Redirect at 600,
HttpCompression at 590 and Retry at 550) judges each response or exception, quarantines banned
proxies for every host at once and retries the request through another proxy.
``ProxyShardGuardMiddleware`` (950, after every built-in) is the last line: a request the plugin is
responsible for that reaches it without the proxy leased for it is dropped, never sent (wiring.py
checks the orders at start).

Each leased request gets its own Scrapy download slot, ``<site>|<proxy id>``, which sends it at once:
the lease already enforces per-(proxy, site) concurrency and pacing for every host, and a slot's
host-local ``DOWNLOAD_DELAY`` or ``CONCURRENT_REQUESTS_PER_DOMAIN`` would send it after its lease
(crawl/slots.py). ``DOWNLOAD_DELAY`` is kept at the lease instead: the floor of every site's interval
per IP (settings.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

from scrapy import Request, Spider
from scrapy.downloadermiddlewares.retry import get_retry_request
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.http import Response
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import build_from_crawler, load_object

from scrapy_proxy_shard.crawl import browser, impersonate
from scrapy_proxy_shard.crawl.content import CONTENT_REASONS, describe
from scrapy_proxy_shard.crawl.contexts import BrowserContexts
from scrapy_proxy_shard.crawl.handlers import HandlerMap, Route
from scrapy_proxy_shard.crawl.runtime import STATS, ShardRuntime
from scrapy_proxy_shard.crawl.slots import leased_slot
from scrapy_proxy_shard.crawl.startup import StartupGate
from scrapy_proxy_shard.engine.proxies import mask
from scrapy_proxy_shard.engine.schema import check_session_id
from scrapy_proxy_shard.exceptions import (
    InvalidSessionId,
    ProxyBanned,
    ProxyShardError,
    RequestKept,
    SettingError,
    UnknownPoolError,
)
from scrapy_proxy_shard.policy import FINE, Verdict, retry_after_seconds
from scrapy_proxy_shard.settings import ShardSettings

logger = logging.getLogger(__name__)

#: meta key marking a proxy set by this middleware (so a retry or copy is leased again, while a
#: proxy the user set in meta is left alone).
OWN_PROXY = "_proxy_shard_proxy"
OWN_SLOT = "_proxy_shard_slot"


class RequestNotLeased(IgnoreRequest):
    """A request the plugin is responsible for could not get (or lost) its leased proxy: dropped."""


def _enabled_runtime(crawler: Any) -> ShardRuntime | None:
    """The crawler's runtime; None when the plugin cannot start; NotConfigured only when switched off.

    A bad setting does not disable the middleware (that would silently send every request from the
    host's own IP): the start-up gate logs it, stops the crawl at open and makes it exit non-zero,
    and the middlewares refuse every request meanwhile.
    """
    gate = StartupGate.for_crawler(crawler)
    try:
        if not ShardSettings.for_crawler(crawler).enabled:
            raise NotConfigured("PROXY_SHARD_ENABLED is False")
        runtime = ShardRuntime.for_crawler(crawler)
    except ProxyShardError as exc:
        gate.fail(exc)
        return None
    return None if gate.error is not None else runtime


def _handler_map(runtime: ShardRuntime | None, crawler: Any) -> HandlerMap:
    """The crawler's download handlers (crawl/handlers.py); without a runtime, none declared."""
    declared = runtime.settings.proxy_aware_handlers if runtime is not None else ()
    return HandlerMap.for_crawler(crawler, declared)


def _user_proxy(meta: dict) -> bool:
    """``meta['proxy']`` is a proxy URL the user set (not the plugin): a non-empty string. None or ''
    is no proxy at all: such a request is leased like any other."""
    proxy = meta.get("proxy")
    return isinstance(proxy, str) and bool(proxy.strip()) and OWN_PROXY not in meta


def _opted_out(meta: dict) -> bool:
    """The request says "do not lease me": ``meta['proxy_shard'] = False`` (or the older
    ``meta['proxy_shard_skip'] = True``, still honoured)."""
    return meta.get("proxy_shard") is False or bool(meta.get("proxy_shard_skip"))


def left_alone_as(meta: dict, route: Route) -> str | None:
    """How a request the plugin does not lease leaves the host, or None when it must be leased.

    ``local`` (file://, data:: it does not leave), ``own_proxy`` (through the user's non-empty
    ``meta['proxy']``, by a handler that honours it) or ``direct`` (an opt-out without a proxy, or a
    user's proxy the handler ignores: from this host's own IP, allowed only by PROXY_SHARD_ALLOW_DIRECT).
    """
    if route.kind == "local":
        return "local"
    user_proxy = _user_proxy(meta)
    if not user_proxy and not _opted_out(meta):
        return None
    return "own_proxy" if user_proxy and route.kind == "proxy" else "direct"


def _direct_reason(meta: dict, route: Route) -> str:
    if _user_proxy(meta):
        return f"its download handler ignores meta['proxy'] ({route.reason or 'a browser request'})"
    return "it opted out of the proxy pool (meta['proxy_shard'] = False) and has no meta['proxy']"


class ProxyShardMiddleware:
    """Lease a proxy for every request from the shared pool; release it when the request ends."""

    def __init__(self, runtime: ShardRuntime | None, crawler: Any = None) -> None:
        self.runtime = runtime
        self.crawler = runtime.crawler if runtime is not None else crawler
        self.handlers = _handler_map(runtime, self.crawler)
        if runtime is not None and runtime.browser is None and self.handlers.has_browser:
            runtime.browser = BrowserContexts.from_runtime(runtime)

    @classmethod
    def from_crawler(cls, crawler: Any) -> ProxyShardMiddleware:
        return cls(_enabled_runtime(crawler), crawler)

    async def process_request(self, request: Request, spider: Spider | None = None) -> None:
        """Lease a proxy for ``request``. A request that ends here without one is never sent: counted
        in ``proxy_shard/not_sent`` (unless JOBDIR keeps it for the next run, ``RequestKept``); a crawl
        that finishes with any exits with code 1 (crawl/liveness.py)."""
        try:
            return await self._lease(request, spider)
        except RequestKept:
            raise
        except Exception:
            stats = getattr(self.crawler, "stats", None)
            if stats is not None:
                stats.inc_value(f"{STATS}/not_sent")
            raise

    async def _lease(self, request: Request, spider: Spider | None) -> None:
        meta = request.meta
        if self.runtime is None:
            raise RequestNotLeased("scrapy-proxy-shard could not start (see the 'cannot start' line)")
        route = self.handlers.route(request)
        alone = left_alone_as(meta, route)
        if alone is not None:
            if alone == "direct" and not self.runtime.settings.allow_direct:
                self.runtime.stats.inc_value(f"{STATS}/direct_refused")
                problem = (f"{_direct_reason(meta, route)}, and PROXY_SHARD_ALLOW_DIRECT is False: it would go out "
                           f"from this host's own IP")
                logger.error("proxy_shard: %(url)s not sent: %(p)s", {"url": request.url, "p": problem})
                raise RequestNotLeased(f"{request.url}: {problem}")
            self.runtime.stats.inc_value(f"{STATS}/{'local' if alone == 'local' else 'skipped'}")
            self.runtime.left_alone.add(request)
            return None
        problem, stat = None, ""
        if route.kind == "refused":
            problem, stat = route.reason, "handler_refused"
        elif route.kind == "browser":
            problem, stat = browser.bind_problem(meta), "browser_refused"
        if problem is None and route.family == "impersonate":
            problem, stat = impersonate.request_problem(meta), "impersonate_refused"
        if problem is not None:
            self.runtime.stats.inc_value(f"{STATS}/{stat}")
            logger.error("proxy_shard: %(url)s not sent: %(p)s", {"url": request.url, "p": problem})
            raise RequestNotLeased(f"{request.url}: {problem}")
        if self.runtime.open_error is not None:
            raise self.runtime.open_error
        if self.runtime.lease_of(request) is not None:
            return None  # already leased (a middleware returned this same request object again)
        spider = spider or getattr(self.crawler, "spider", None)
        try:
            pool = self.runtime.pool_for(request, spider)
            host = urlparse_cached(request).hostname  # parsed once per request by Scrapy (cached)
            site = self.runtime.sites.key_for_host(host) if host else self.runtime.sites.key_for_request(request)
            session = _session_id(request, self.runtime.stats)
            lease = await self.runtime.tiers.acquire(request, spider, pool, site, session)  # crawl/tiers.py
        except (UnknownPoolError, SettingError) as exc:
            self.runtime.stats.inc_value(f"{STATS}/pool_errors")
            logger.error("proxy_shard: %(url)s not sent: %(e)s", {"url": request.url, "e": exc})
            raise RequestNotLeased(f"{request.url}: {exc}") from None
        meta["proxy"] = lease.proxy_url
        meta[OWN_PROXY] = lease.proxy_id
        meta["proxy_shard_proxy_id"] = lease.proxy_id
        if route.kind == "browser":
            await self.runtime.browser.bind(request, lease, session)
        if "download_slot" not in meta or OWN_SLOT in meta:
            key = meta["download_slot"] = meta[OWN_SLOT] = f"{lease.site}|{lease.proxy_id}"
            leased_slot(self.crawler, key, meta)  # sent at once: no Scrapy delay or queue after the lease
        return None

    async def process_response(self, request: Request, response: Response,
                               spider: Spider | None = None) -> Response:
        if self.runtime is not None:
            lease = self.runtime.lease_of(request)
            if lease is not None:
                await self.runtime.gateways.saw_response(lease, response.headers)
            await self.runtime.finish(request, "ok" if response.status < 400 else "unknown")
        return response

    async def process_exception(self, request: Request, exception: Exception,
                                spider: Spider | None = None) -> None:
        if self.runtime is not None:
            await self.runtime.finish(request, "error", reason=type(exception).__name__)
        return None


class BanDetectionMiddleware:
    """Detect bans in responses and exceptions; quarantine the proxy and retry through another."""

    def __init__(self, runtime: ShardRuntime | None, policy: Any, crawler: Any = None) -> None:
        self.runtime = runtime
        self.crawler = runtime.crawler if runtime is not None else crawler
        self.policy = policy
        self._closing: set[asyncio.Future] = set()  # pages of banned answers being closed

    @classmethod
    def from_crawler(cls, crawler: Any) -> BanDetectionMiddleware:
        runtime = _enabled_runtime(crawler)
        if runtime is None:
            return cls(None, None, crawler)
        try:
            policy_cls = load_object(runtime.settings.ban_policy)
        except (ImportError, NameError, ValueError, AttributeError) as exc:
            StartupGate.for_crawler(crawler).fail(SettingError(
                f"PROXY_SHARD_BAN_POLICY ({runtime.settings.ban_policy!r}) cannot be loaded: {exc}"
            ))
            return cls(None, None, crawler)
        return cls(runtime, build_from_crawler(policy_cls, crawler))

    async def process_response(self, request: Request, response: Response,
                               spider: Spider | None = None) -> Request | Response:
        if self.runtime is None or self.runtime.lease_of(request) is None:
            return response
        await self.runtime.gateways.saw_response(self.runtime.lease_of(request), response.headers)
        spider = spider or self.crawler.spider
        verdict = self._response_verdict(request, response, spider)
        if verdict.kind == "ban" and verdict.reason in CONTENT_REASONS:
            # A check that never passed on the site may be wrong, not the proxy (crawl/content.py).
            check = self._check_of(request, response, spider)
            if await self.runtime.content.failed(self.runtime.lease_of(request), check, request):
                await self.runtime.finish(request, "unknown", reason=verdict.reason)
                return self._retry(request, verdict, spider)
        elif verdict.kind == "fine" and self._required_css(request, spider, response):
            await self.runtime.content.passed(self.runtime.lease_of(request))
        if verdict.kind in ("ban", "dead"):
            told = None
            if verdict.kind == "ban" and self.runtime.settings.retry_after:
                told = retry_after_seconds(response)  # the site says when the IP may come back
            result = await self.runtime.finish(request, verdict.kind, reason=verdict.reason, retry_after=told)
            return self._retry(request, verdict, spider, charge=not _spared(result))
        await self.runtime.finish(request, "ok" if verdict.kind == "fine" else "unknown")
        return response

    async def process_exception(self, request: Request, exception: Exception,
                                spider: Spider | None = None) -> Request | None:
        if self.runtime is None or self.runtime.lease_of(request) is None or isinstance(exception, IgnoreRequest):
            return None
        spider = spider or self.crawler.spider
        verdict = self._exception_verdict(request, exception, spider)
        if verdict.kind not in ("ban", "dead"):
            return None  # ProxyShardMiddleware releases it as an error
        result = await self.runtime.finish(request, verdict.kind, reason=verdict.reason)
        try:
            return self._retry(request, verdict, spider, charge=not _spared(result))
        except ProxyBanned:
            return None  # budget spent: the original exception reaches the errback

    def _response_verdict(self, request: Request, response: Response, spider: Any) -> Verdict:
        said = _spider_says(spider, "response_is_ban", request, response)
        if said is not None:
            return Verdict("ban", "spider") if said else FINE
        return self.policy.response_verdict(request, response, required_css=self._required_override(request, spider))

    @staticmethod
    def _required_override(request: Request, spider: Any) -> list[str] | None:
        """Required CSS from meta, else the spider attribute (None: the policy's site rule / setting)."""
        required = request.meta.get("proxy_shard_required_css", getattr(spider, "proxy_shard_required_css", None))
        return [required] if isinstance(required, str) else required

    def _required_css(self, request: Request, spider: Any, response: Response) -> tuple[str, ...]:
        """The selectors the page had to hold (empty: no CSS check applies to it)."""
        selectors = getattr(self.policy, "required_selectors", None)
        override = self._required_override(request, spider)
        if selectors is None:
            return tuple(override or ())
        return selectors(request, response, override)

    def _check_of(self, request: Request, response: Response, spider: Any) -> str:
        """The failing check as logged: the required selectors the page lacks (all of them if unknown)."""
        required = self._required_css(request, spider, response)
        missing = []
        for selector in required:
            try:
                if not response.css(selector):
                    missing.append(selector)
            except Exception:  # not HTML text, a bad selector: name them all
                missing = list(required)
                break
        return describe(tuple(missing or required))

    def _exception_verdict(self, request: Request, exception: Exception, spider: Any) -> Verdict:
        said = _spider_says(spider, "exception_is_ban", request, exception)
        if said is not None:
            return Verdict("ban", "spider_exception") if said else Verdict("unknown")
        return self.policy.exception_verdict(request, exception)

    def _retry(self, request: Request, verdict: Verdict, spider: Spider, *, charge: bool = True) -> Request:
        """A copy of ``request`` for another proxy, or ProxyBanned once the budget is spent.

        ``charge=False``: the site's circuit breaker spared the proxy (the site rejects everyone), so
        the retry waits for the breaker and costs nothing of the ban budget.

        Scrapy's ``get_retry_request`` does the copy, priority, logging and stats
        (``proxy_shard/ban_retries/count``, ``.../reason_count/<reason>``, ``.../max_reached``).
        Ban retries keep their own budget (``PROXY_SHARD_BAN_RETRIES``, meta
        ``proxy_shard_max_ban_retries``) and counter (meta ``proxy_shard_ban_retries``): a ban
        is not a network failure, so it must neither spend nor be limited by ``RETRY_TIMES``.
        Hence ``max_retry_times`` is the request's ``retry_times`` plus what is left of the
        ban budget, and the copy gets its ``retry_times`` back.
        """
        done = int(request.meta.get("proxy_shard_ban_retries", 0))
        limit = int(request.meta.get("proxy_shard_max_ban_retries", self.runtime.settings.ban_retries))
        retry_times = request.meta.get("retry_times")
        retry = get_retry_request(
            request,
            spider=spider,
            reason=verdict.reason or verdict.kind,
            max_retry_times=(retry_times or 0) + limit - done,
            logger=logger,
            give_up_log_level=logging.WARNING,
            stats_base_key=f"{STATS}/ban_retries",
        )
        if retry is None:
            raise ProxyBanned(
                f"{request.url}: banned ({verdict.reason}) through {done + 1} proxies; "
                f"the retry budget ({limit}) is spent"
            )
        if retry_times is None:
            retry.meta.pop("retry_times", None)
        else:
            retry.meta["retry_times"] = retry_times
        retry.meta["proxy_shard_ban_retries"] = done + 1 if charge else done
        browser.unbind(retry.meta)  # the context's kwargs hold the proxy's credentials: not into a queue
        self._drop_page(request, retry)
        return retry

    def _drop_page(self, request: Request, retry: Request) -> None:
        """A browser page of the banned answer is no page for the retry (another proxy, another
        context); one scrapy-playwright kept for the spider (``playwright_include_page``) is closed:
        the spider never sees this answer."""
        page = retry.meta.pop("playwright_page", None)
        if page is None or not request.meta.get("playwright_include_page"):
            return
        try:
            task = asyncio.ensure_future(page.close())
        except Exception:  # not a Playwright page
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _spared(result: Any) -> bool:
    """The release's ban was spared by the site's circuit breaker (open or half-open: no quarantine)."""
    event = getattr(result, "breaker", None)
    return event is not None and event.kind in ("spared", "reopened")


def _session_id(request: Request, stats: Any) -> str | None:
    """The request's sticky session id; a bad one fails this request (one ERROR line, a stat)."""
    try:
        return check_session_id(request.meta.get("session_id"))
    except InvalidSessionId as exc:
        stats.inc_value(f"{STATS}/invalid_session_id")
        logger.error("proxy_shard: %(url)s dropped: %(error)s", {"url": request.url, "error": exc})
        raise


def _spider_says(spider: Any, method: str, request: Request, subject: Any) -> bool | None:
    """The spider's own verdict (``response_is_ban`` / ``exception_is_ban``): True, False, or None to
    leave it to the policy."""
    override = getattr(spider, method, None)
    if not callable(override):
        return None
    said = override(request, subject)
    return said if isinstance(said, bool) else None


class ProxyShardGuardMiddleware:
    """The last line (950, after every built-in): a request the plugin is responsible for goes out
    through the proxy leased for it, by a download handler that uses it, or not at all.

    Responsible means: the lease middleware leased it, or never saw it. Such a request is dropped
    with ``RequestNotLeased`` (an IgnoreRequest: its errback gets it, the lease is released) when it
    has no lease, when ``meta['proxy']`` no longer points at the leased proxy (removed, None or
    changed by a middleware in between; ``HttpProxyMiddleware`` strips the credentials from it, so
    the endpoints are compared), or when the handler that will download it does not use the proxy
    (crawl/handlers.py): a browser request of scrapy-playwright must carry the context bound to its
    leased proxy (crawl/browser.py). A request left alone is checked again as it now stands: through
    the user's own proxy by a handler that honours it, local (file://, data:), or a direct send,
    counted (``proxy_shard/direct``) and logged at WARNING when PROXY_SHARD_ALLOW_DIRECT allows it,
    dropped otherwise.
    """

    def __init__(self, runtime: ShardRuntime | None, crawler: Any) -> None:
        self.runtime = runtime
        self.crawler = crawler
        self.handlers = _handler_map(runtime, crawler)

    @classmethod
    def from_crawler(cls, crawler: Any) -> ProxyShardGuardMiddleware:
        return cls(_enabled_runtime(crawler), crawler)

    def process_request(self, request: Request, spider: Spider | None = None) -> None:
        problem = self._problem(request)
        if problem is None:
            return None
        self.crawler.stats.inc_value(f"{STATS}/guard/dropped")
        self.crawler.stats.inc_value(f"{STATS}/not_sent")
        logger.error("proxy_shard: dropped %(url)s before download: %(problem)s",
                     {"url": request.url, "problem": problem})
        raise RequestNotLeased(f"{request.url}: {problem}")

    def _problem(self, request: Request) -> str | None:
        runtime = self.runtime
        route = self.handlers.route(request)
        lease = runtime.lease_of(request) if runtime is not None else None
        if lease is None:
            if runtime is not None and request in runtime.left_alone:
                return self._left_alone_problem(request, route)
            if runtime is None and left_alone_as(request.meta, route) in ("local", "own_proxy"):
                return None
            return "no proxy was leased for it"
        if route.kind not in ("proxy", "browser"):
            return f"its download handler will not use the leased proxy: {route.reason}"
        sent = request.meta.get("proxy")
        if not isinstance(sent, str) or not sent:
            return f"meta['proxy'] is {sent!r}, not the leased proxy {lease.proxy_id}"
        if _endpoint(sent) != _endpoint(lease.proxy_url):
            return f"meta['proxy'] ({mask(sent)}) is not the leased proxy {lease.proxy_id}"
        if route.kind == "browser":
            problem = browser.binding_problem(request, lease.proxy_id, lease.proxy_url, self.crawler)
            if problem is not None:
                return problem
            browser.drop_proxy_authorization(request)
        if route.family == "impersonate":
            problem = impersonate.request_problem(request.meta)
            if problem is not None:
                return problem
            impersonate.pin_proxy(request.meta)
        return None

    def _left_alone_problem(self, request: Request, route: Route) -> str | None:
        alone = left_alone_as(request.meta, route)
        if alone is None:
            return f"no proxy was leased for it, and its meta['proxy'] is now {request.meta.get('proxy')!r}"
        if alone == "own_proxy" and route.family == "impersonate":  # your proxy, still not bypassed
            problem = impersonate.request_problem(request.meta)
            if problem is None:
                impersonate.pin_proxy(request.meta)
            return problem
        if alone != "direct":
            return None
        reason = _direct_reason(request.meta, route)
        if not self.runtime.settings.allow_direct:
            self.crawler.stats.inc_value(f"{STATS}/direct_refused")
            return f"{reason}, and PROXY_SHARD_ALLOW_DIRECT is False: it would go out from this host's own IP"
        self.crawler.stats.inc_value(f"{STATS}/direct")
        logger.warning("proxy_shard: %(url)s goes out DIRECT, from this host's own IP: %(reason)s "
                       "(PROXY_SHARD_ALLOW_DIRECT)", {"url": request.url, "reason": reason})
        return None


_DEFAULT_PORTS = {"http": 80, "https": 443, "socks5": 1080, "socks5h": 1080}


def _endpoint(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a proxy URL, credentials ignored."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return ("", url, None)
