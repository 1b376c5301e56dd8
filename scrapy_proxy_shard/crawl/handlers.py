"""Which download handler will download a request, and whether it goes out through ``meta['proxy']``.

The guard used to check ``meta['proxy']`` only; but a handler decides what it does with it, and
several send from the host's own IP whatever it says: scrapy-playwright's browser, Scrapy's FTP
handler, a project's own handler. This module resolves, from the crawler's settings as Scrapy's
downloader does (``DOWNLOAD_HANDLERS_BASE`` merged with ``DOWNLOAD_HANDLERS``; ``None`` disables a
scheme), the handler of each scheme and sorts it into one kind:

- ``proxy``: honours ``meta['proxy']``: Scrapy's HTTP/1.1 handler (and its deprecated alias in
  ``scrapy.core.downloader.handlers.http``), the aiohttp and httpx handlers Scrapy 2.19 ships (the
  aiohttp one is its http/https default without a reactor), scrapy-impersonate 1.8.0 or later
  (curl_cffi gets ``meta['proxy']`` and the credentials from HttpProxyMiddleware's
  ``Proxy-Authorization``, sent to the proxy only; checked in jxlil/scrapy-impersonate f9dd600,
  handler.py / parser.py; its escape hatches, ``no_proxy`` in the environment and a proxy of the
  request's own in ``impersonate_args`` / ``impersonate_curl_options``: crawl/impersonate.py), and
  any class listed in ``PROXY_SHARD_PROXY_AWARE_HANDLERS``;
- ``playwright``: scrapy-playwright's handler or any subclass of it (declared or not): a
  ``meta['playwright']`` request is downloaded by the browser
  in the browser context named by ``meta['playwright_context']`` (``meta['proxy']`` is ignored), any
  other request by Scrapy's HTTP/1.1 handler it inherits;
- ``local``: ``file://`` and ``data:``: nothing leaves the host; no lease is needed;
- ``no_proxy``: Scrapy's own FTP and S3 handlers, defaults nobody chose: each request for them is
  refused when it comes, rather than the whole crawl;
- ``outdated``: scrapy-impersonate before 1.8.0 (or its version unknown): before 1.7.1 it also sent
  ``Proxy-Authorization`` to the site (inside the CONNECT tunnel for https); the crawl is refused at
  start-up, one line naming the version and the upgrade;
- ``unknown``: anything else, including Scrapy's HTTP/2 handler (it raises NotImplementedError for
  any request with ``meta['proxy']``): the crawl is refused at start-up, one line naming the handler
  and the setting that accepts it.

Handlers are compared by exact class (a subclass of a proxy-aware handler may override
``download_request`` and ignore the proxy), by the path written in the settings first, so that a
known path is never imported here (Scrapy's deprecated alias warns on import). The exception is
scrapy-playwright: any other class that loads is checked for being its subclass first (importing
scrapy_playwright then), since its browser ignores ``meta['proxy']`` whatever the subclass declares.
"""

from __future__ import annotations

import hashlib
import importlib
import secrets
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from packaging.version import InvalidVersion, Version
from scrapy import Request
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import load_object

from scrapy_proxy_shard.exceptions import SettingError

_HANDLERS = "scrapy.core.downloader.handlers"
HTTP11 = f"{_HANDLERS}.http11.HTTP11DownloadHandler"
H2 = f"{_HANDLERS}.http2.H2DownloadHandler"
PLAYWRIGHT = "scrapy_playwright.handler.ScrapyPlaywrightDownloadHandler"
IMPERSONATE = "scrapy_impersonate.ImpersonateDownloadHandler"
#: Handlers known to send every request through ``meta['proxy']``.
PROXY_AWARE = frozenset({
    HTTP11,
    f"{_HANDLERS}.http.HTTPDownloadHandler",
    f"{_HANDLERS}._aiohttp.AiohttpDownloadHandler",
    f"{_HANDLERS}._httpx.HttpxDownloadHandler",
    IMPERSONATE,
    "scrapy_impersonate.handler.ImpersonateDownloadHandler",
})
LOCAL = frozenset({f"{_HANDLERS}.file.FileDownloadHandler", f"{_HANDLERS}.datauri.DataURIDownloadHandler"})
#: Scrapy's own handlers that connect from this host: path -> what to say.
NO_PROXY = {
    f"{_HANDLERS}.ftp.FTPDownloadHandler": "Scrapy's FTP handler connects from this host's own IP",
    f"{_HANDLERS}.s3.S3DownloadHandler": "Scrapy's S3 handler is not supported through the proxy pool",
}
#: Why a known handler is refused at start-up (the generic reason otherwise).
UNKNOWN_REASONS = {H2: "it cannot download through a proxy (Scrapy raises NotImplementedError for any request "
                       "with meta['proxy']): use HTTP11DownloadHandler"}
DECLARE_SETTING = "PROXY_SHARD_PROXY_AWARE_HANDLERS"
#: scrapy-impersonate paths, and the first release the plugin trusts: 1.7.1 keeps ``Proxy-Authorization``
#: off the wire to the site (jxlil/scrapy-impersonate 775b090: before it the header HttpProxyMiddleware
#: sets was also sent as an ordinary header, inside the CONNECT tunnel for https), and 1.8.0 applies
#: ``meta['impersonate_curl_options']``, which the plugin needs to keep ``no_proxy`` in the environment
#: from sending requests around the proxy (crawl/impersonate.py; 1.7.1 has no way to set it).
IMPERSONATE_PATHS = frozenset({IMPERSONATE, "scrapy_impersonate.handler.ImpersonateDownloadHandler"})
IMPERSONATE_MIN = Version("1.8.0")
#: Paths sorted without importing them (Scrapy's deprecated alias warns on import).
_KNOWN = PROXY_AWARE | LOCAL | frozenset(NO_PROXY) | frozenset(UNKNOWN_REASONS) | {PLAYWRIGHT}
#: The scrapy-playwright context a lease binds a browser request to: this prefix + the proxy id + a
#: short hash of the proxy's full URL (crawl/browser.py). Reserved: PLAYWRIGHT_CONTEXTS may not use it.
CONTEXT_PREFIX = "proxy-shard:"
#: Key of the URL hash in context names: per process (contexts live in one process), so a name seen
#: in a log or a JOBDIR cannot be used to test guesses of the proxy's password offline.
_CONTEXT_KEY = secrets.token_bytes(16)


@dataclass(frozen=True)
class Handler:
    scheme: str
    path: str  # as written in the settings (a class is given its dotted path)
    kind: str  # proxy, playwright, local, no_proxy, outdated, unknown
    reason: str = ""
    #: "impersonate": scrapy-impersonate's handler (a re-export, or a declared subclass): its curl_cffi
    #: requests get the checks of crawl/impersonate.py.
    family: str = ""


@dataclass(frozen=True)
class Route:
    """How one request will be downloaded: ``proxy`` (through ``meta['proxy']``), ``browser``
    (scrapy-playwright's browser, through its context), ``local`` (never leaves the host) or
    ``refused`` (``reason`` says why)."""

    kind: str
    handler: str
    reason: str = ""
    family: str = ""


def _path_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"


def _impersonate_version() -> str | None:
    try:
        return metadata.version("scrapy-impersonate")
    except metadata.PackageNotFoundError:
        return None


def _impersonate_problem() -> str:
    """Why the installed scrapy-impersonate may not be trusted with a leased proxy ("" if it may)."""
    found = _impersonate_version()
    try:
        if found is not None and Version(found) >= IMPERSONATE_MIN:
            return ""
    except InvalidVersion:
        pass
    what = "is not installed" if found is None else f"is version {found}"
    return (f"scrapy-impersonate {what}: releases before 1.7.1 send the proxy's Proxy-Authorization header to "
            f"the site itself, and before {IMPERSONATE_MIN} let no_proxy in the environment send requests around "
            f"the proxy; upgrade it (pip install 'scrapy-impersonate>={IMPERSONATE_MIN}')")


def _is_playwright(cls: Any) -> bool:
    """``cls`` is scrapy-playwright's handler or a subclass (scrapy_playwright imported only here)."""
    if not isinstance(cls, type):
        return False
    try:
        base = importlib.import_module("scrapy_playwright.handler").ScrapyPlaywrightDownloadHandler
    except Exception:  # not installed (or broken): cls cannot be its subclass
        return False
    return issubclass(cls, base)


def _is_impersonate(cls: Any) -> bool:
    """``cls`` is scrapy-impersonate's handler or a subclass (only looked for once it is imported:
    loading ``cls`` imported it, if it is one)."""
    module = sys.modules.get("scrapy_impersonate.handler")
    base = getattr(module, "ImpersonateDownloadHandler", None)
    return isinstance(cls, type) and base is not None and issubclass(cls, base)


def _kind(path: str, declared: frozenset[str]) -> tuple[str, str]:
    if path in IMPERSONATE_PATHS:
        problem = _impersonate_problem()
        return ("outdated", problem) if problem else ("proxy", "")
    if path in declared or path in PROXY_AWARE:
        return "proxy", ""
    if path == PLAYWRIGHT:
        return "playwright", ""
    if path in LOCAL:
        return "local", ""
    if path in NO_PROXY:
        return "no_proxy", NO_PROXY[path]
    return "unknown", UNKNOWN_REASONS.get(path, "it is not known to send requests through meta['proxy']")


def classify(value: Any, scheme: str, declared: frozenset[str]) -> Handler:
    """The kind of handler ``value`` (a dotted path or a class) configured for ``scheme``."""
    path = _path_of(value)
    real = path
    family = "impersonate" if path in IMPERSONATE_PATHS else ""
    if path not in _KNOWN:
        try:
            loaded = load_object(value) if isinstance(value, str) else value
        except Exception:  # Scrapy reports an unloadable handler itself
            loaded = None
        if loaded is not None:
            # scrapy-playwright's handler, subclassed: its browser ignores meta['proxy'] whatever the
            # subclass declares, so its browser requests must be bound like the stock handler's.
            if _is_playwright(loaded):
                return Handler(scheme, path, "playwright")
            real = _path_of(loaded)  # a re-export of a known class under another name is that class
            if _is_impersonate(loaded):
                family = "impersonate"
    kind, reason = _kind(path, declared)
    if kind == "unknown" and real != path and path not in UNKNOWN_REASONS:
        kind, reason = _kind(real, declared)
    return Handler(scheme, path, kind, reason, family)


class HandlerMap:
    """Scheme -> handler of one crawler, as Scrapy's downloader will load them."""

    ATTRIBUTE = "_proxy_shard_handlers"

    def __init__(self, settings: Any, declared: tuple[str, ...] = ()) -> None:
        merged = settings.getwithbase("DOWNLOAD_HANDLERS")
        known = frozenset(declared)
        self.handlers: dict[str, Handler] = {
            scheme: classify(value, scheme, known) for scheme, value in merged.items() if value is not None
        }
        self._startup_contexts = list(settings.getdict("PLAYWRIGHT_CONTEXTS") or {})

    @classmethod
    def for_crawler(cls, crawler: Any, declared: tuple[str, ...] = ()) -> HandlerMap:
        found = getattr(crawler, cls.ATTRIBUTE, None)
        if found is None:
            found = cls(crawler.settings, declared)
            setattr(crawler, cls.ATTRIBUTE, found)
        return found

    @property
    def has_browser(self) -> bool:
        """A scheme is downloaded by scrapy-playwright's handler (or a subclass)."""
        return any(h.kind == "playwright" for h in self.handlers.values())

    def check(self) -> None:
        """Raise SettingError (one line) for the first handler the crawl must not start with."""
        for handler in self.handlers.values():
            if handler.kind == "outdated":
                raise SettingError(f"DOWNLOAD_HANDLERS[{handler.scheme!r}] is {handler.path!r}: {handler.reason}")
            if handler.kind == "unknown":
                raise SettingError(
                    f"DOWNLOAD_HANDLERS[{handler.scheme!r}] is {handler.path!r}: {handler.reason}, so its requests "
                    f"could leave from this host's own IP; if it does use meta['proxy'], add it to {DECLARE_SETTING}"
                )
        if any(h.kind == "playwright" for h in self.handlers.values()):
            for name in self._startup_contexts:
                if str(name).startswith(CONTEXT_PREFIX):
                    raise SettingError(f"PLAYWRIGHT_CONTEXTS defines {name!r}: names starting with "
                                       f"{CONTEXT_PREFIX!r} are reserved for the contexts bound to leased "
                                       f"proxies (proxy-shard:<proxy id>:<hash>); rename it")

    def route(self, request: Request) -> Route:
        scheme = urlparse_cached(request).scheme
        handler = self.handlers.get(scheme)
        if handler is None:
            return Route("refused", "", f"no download handler is enabled for scheme {scheme!r}")
        if handler.kind == "proxy":
            return Route("proxy", handler.path, family=handler.family)
        if handler.kind == "playwright":
            return Route("browser" if request.meta.get("playwright") else "proxy", handler.path)
        if handler.kind == "local":
            return Route("local", handler.path)
        return Route("refused", handler.path, f"{handler.reason} ({handler.path})")


def context_name(proxy_id: str, proxy_url: str) -> str:
    """The scrapy-playwright context bound to a proxy: one per proxy *and credentials*, never shared.

    The proxy id hashes the exit (host:port) only, and scrapy-playwright reuses a context by name,
    ignoring new kwargs: without the URL's hash, an exit whose password was rotated (CLI add/load)
    would keep authenticating with the old one. The hash is keyed; the credentials never appear."""
    digest = hashlib.blake2b(proxy_url.encode(), digest_size=4, key=_CONTEXT_KEY).hexdigest()
    return f"{CONTEXT_PREFIX}{proxy_id}:{digest}"
