"""Ban detection: is this response or download error a ban, a dead proxy, fine, or unknown?

Pure predicates in the manner of scrapy-rotating-proxies' ``policy.py``: the policy takes Scrapy
``Request`` / ``Response`` / exception objects and returns a ``Verdict``; it never touches Redis or
the engine. The middleware turns a verdict into a quarantine (``ban``: this proxy on this site;
``dead``: this proxy everywhere) and a retry. Subclass ``BanPolicy`` (or set a spider's
``response_is_ban`` / ``exception_is_ban``) to change the rules.

Bans come in disguises, and each needs its own detector: a status code (403, 429, 503), a redirect
to a captcha or login page, the captcha page itself reached through such a redirect, and a 200 page
that is not the page asked for — a stub without the site's usual content (missing required CSS
selectors) or much smaller than the site's usual pages (rolling median of recent good pages).

Content checks read the *decoded* body: the middleware runs before Scrapy's
``HttpCompressionMiddleware``, so the body may still be gzip/deflate/br/zstd-compressed.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urljoin, urlsplit

from scrapy.http import HtmlResponse, Request, Response
from scrapy.responsetypes import responsetypes
from twisted.internet import defer
from twisted.internet import error as tx_error
from twisted.python.failure import Failure
from twisted.web._newclient import ResponseFailed, ResponseNeverReceived
from w3lib.url import safe_url_string

from scrapy_proxy_shard.crawl.decoding import decode_body
from scrapy_proxy_shard.engine.sites import registrable_domain, site_of_url
from scrapy_proxy_shard.settings import (
    DEFAULT_BAN_CODES,
    DEFAULT_CHALLENGE_PATTERNS,
    DEFAULT_CHALLENGE_REGEXES,
    DEFAULT_MAX_DECODED_SIZE,
    DEFAULT_PROXY_FAILURE_CODES,
    DEFAULTS,
    PolicyOptions,
    ShardSettings,
    SiteContentRules,
    compile_patterns,
    css_tuple,
)

__all__ = [
    "DEFAULT_BAN_CODES",
    "DEFAULT_CHALLENGE_PATTERNS",
    "DEFAULT_CHALLENGE_REGEXES",
    "DEFAULT_PROXY_FAILURE_CODES",
    "EXCEPTION_REASONS",
    "FINE",
    "UNKNOWN",
    "BanPolicy",
    "PolicyOptions",
    "SiteContentRules",
    "Verdict",
]

KINDS = frozenset({"ban", "dead", "fine", "unknown"})
_REASON_RE = re.compile(r"^[a-z0-9_:-]*$")


@dataclass(frozen=True)
class Verdict:
    """What a response or error says about the proxy that carried it.

    ``kind``: ``ban`` (quarantine the proxy on this site), ``dead`` (quarantine the proxy everywhere:
    the proxy itself failed), ``fine`` (count a success), ``unknown`` (no evidence either way).
    ``reason`` is a short slug used in stats keys and Redis, so it is restricted to ``[a-z0-9_:-]``.
    """

    kind: str
    reason: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Verdict kind {self.kind!r} must be one of {sorted(KINDS)}")
        if not _REASON_RE.match(self.reason):
            raise ValueError(f"Verdict reason {self.reason!r} may only contain [a-z0-9_:-]")


FINE = Verdict("fine")
UNKNOWN = Verdict("unknown")

def _exception_types(module: str, *names: str) -> tuple[type[BaseException], ...]:
    """Exception classes that exist in this Scrapy version (the ``Download*Error`` family is 2.14+)."""
    mod = __import__(module, fromlist=list(names))
    return tuple(getattr(mod, name) for name in names if hasattr(mod, name))


def _tunnel_error() -> tuple[type[BaseException], ...]:
    try:
        from scrapy.core.downloader.handlers.http11 import TunnelError
    except ImportError:  # pragma: no cover - needs Twisted, which Scrapy requires
        return ()
    return (TunnelError,)


#: Download errors that mean the proxy itself is failing, checked in order (first match wins, so
#: subclasses of ``ConnectError`` come before it). Recent Scrapy wraps Twisted's errors in its own
#: ``scrapy.exceptions.Download*Error`` classes; both are listed. Extend it in a subclass:
#: ``exception_reasons = (((MyError,), "my_reason"), *EXCEPTION_REASONS)``.
EXCEPTION_REASONS: tuple[tuple[tuple[type[BaseException], ...], str], ...] = (
    (
        (tx_error.ConnectionRefusedError, *_exception_types("scrapy.exceptions", "DownloadConnectionRefusedError")),
        "connection_refused",
    ),
    (
        (
            tx_error.TCPTimedOutError,
            tx_error.TimeoutError,
            defer.TimeoutError,
            *_exception_types("scrapy.exceptions", "DownloadTimeoutError"),
        ),
        "timeout",
    ),
    ((tx_error.DNSLookupError, *_exception_types("scrapy.exceptions", "CannotResolveHostError")), "dns"),
    (_tunnel_error(), "tunnel_error"),
    (
        (
            tx_error.ConnectionLost,
            tx_error.ConnectionDone,
            ResponseNeverReceived,
            ResponseFailed,
            *_exception_types("scrapy.exceptions", "DownloadFailedError", "ResponseDataLossError"),
        ),
        "connection_lost",
    ),
    ((tx_error.ConnectError,), "connect_error"),
)


_NO_RULES = SiteContentRules()


class BanPolicy:
    """Classifies responses and download errors into verdicts; keeps only body-size statistics.

    Build it directly in tests; ``from_crawler`` takes the crawler's once-parsed ``ShardSettings.policy``,
    ``from_settings`` parses only the policy's ``PROXY_SHARD_*`` settings (both through ``from_options``).
    """

    #: (exception types, reason) pairs for ``exception_verdict``; first match wins.
    exception_reasons: tuple[tuple[tuple[type[BaseException], ...], str], ...] = EXCEPTION_REASONS
    #: How many recent good page sizes per site the learned median is taken over.
    small_body_window: int = 50
    #: Sites whose page sizes are remembered at once (oldest forgotten first): bounds memory on
    #: broad crawls.
    max_tracked_sites: int = 10_000

    def __init__(
        self,
        *,
        ban_codes: Iterable[int] = DEFAULT_BAN_CODES,
        proxy_failure_codes: Iterable[int] = DEFAULT_PROXY_FAILURE_CODES,
        challenge_patterns: Iterable[re.Pattern[str] | str] = DEFAULT_CHALLENGE_PATTERNS,
        required_css: Sequence[str] = (),
        site_rules: Mapping[str, SiteContentRules] | None = None,
        small_body_ratio: float = DEFAULTS["PROXY_SHARD_SMALL_BODY_RATIO"],
        small_body_min_samples: int = DEFAULTS["PROXY_SHARD_SMALL_BODY_MIN_SAMPLES"],
        max_decoded_size: int = DEFAULT_MAX_DECODED_SIZE,
    ) -> None:
        self.ban_codes = frozenset(ban_codes)
        self.proxy_failure_codes = frozenset(proxy_failure_codes)
        self.challenge_patterns = compile_patterns(challenge_patterns)
        self.required_css = css_tuple(required_css, "required_css")
        self.site_rules = {registrable_domain(site): rules for site, rules in (site_rules or {}).items()}
        self.small_body_ratio = small_body_ratio
        self.small_body_min_samples = small_body_min_samples
        #: Decoding stops (verdict ``unknown``) past this many bytes, as DOWNLOAD_MAXSIZE does; 0 = no
        #: limit. A request's ``download_maxsize`` meta key wins, as in Scrapy.
        self.max_decoded_size = max_decoded_size
        self._sizes: dict[str, deque[int]] = {}

    # --- construction from settings ------------------------------------------------------------

    @classmethod
    def from_crawler(cls, crawler: Any) -> BanPolicy:
        """The policy configured by the crawler's settings, as parsed once for the whole crawler."""
        return cls.from_options(ShardSettings.for_crawler(crawler).policy)

    @classmethod
    def from_settings(cls, settings: Any) -> BanPolicy:
        """Parse the policy's ``PROXY_SHARD_*`` settings from a Scrapy Settings object or a mapping.

        Raises ``SettingError`` naming the setting and the bad value.
        """
        return cls.from_options(PolicyOptions.from_settings(settings))

    @classmethod
    def from_options(cls, options: PolicyOptions) -> BanPolicy:
        """The policy for already-parsed options (a subclass with other arguments overrides this)."""
        return cls(**options.as_kwargs())

    # --- responses -----------------------------------------------------------------------------

    def response_verdict(
        self, request: Request, response: Response, *, required_css: Sequence[str] | None = None
    ) -> Verdict:
        """Classify a response; ``required_css`` (resolved by the caller from meta / spider) wins."""
        status = response.status
        if status in self.proxy_failure_codes:
            return Verdict("dead", "proxy_auth" if status == 407 else f"proxy_http_{status}")
        site = _site_or_none(response.url or request.url)
        rules = self.site_rules.get(site, _NO_RULES) if site else _NO_RULES
        if status in (rules.ban_codes if rules.ban_codes is not None else self.ban_codes):
            return Verdict("ban", f"http_{status}")
        patterns = self.challenge_patterns if rules.challenge_patterns is None else rules.challenge_patterns
        if 300 <= status < 400:
            return self._redirect_verdict(response, patterns)
        if _navigated(request, response) and url_matches(response.url, patterns):
            return Verdict("ban", "challenge_page")
        if 200 <= status < 300:
            return self._content_verdict(request, response, site, rules, required_css)
        return UNKNOWN

    def _redirect_verdict(self, response: Response, patterns: Sequence[re.Pattern[str]]) -> Verdict:
        """A redirect to a captcha / login page is a ban; any other redirect is followed as usual."""
        location = response.headers.get(b"Location")
        if not location:
            return UNKNOWN
        target = redirect_target(response.url, location)
        if url_matches(target, patterns):
            return Verdict("ban", "challenge_redirect")
        return UNKNOWN

    def _content_verdict(
        self,
        request: Request,
        response: Response,
        site: str | None,
        rules: SiteContentRules,
        required_css: Sequence[str] | None,
    ) -> Verdict:
        """Checks on a 2xx HTML page: required selectors, then size against a floor and the median."""
        selectors = self._selectors_for(rules, required_css)
        ratio = rules.min_body_ratio if rules.min_body_ratio is not None else self.small_body_ratio
        if not selectors and rules.min_body_size is None and not ratio:
            return FINE
        if request.method == "HEAD" or response.status in (204, 205, 206):
            return FINE  # no body, or a partial one: nothing to judge the page by
        if selectors:
            page = self._html_page(request, response)
            if isinstance(page, Verdict):
                return page
            if any(not page.css(selector) for selector in selectors):
                return Verdict("ban", "missing_css")
            size = len(page.body)
        else:  # size checks only: the decoded body is enough, no second response object to build
            found = self._html_body(request, response)
            if isinstance(found, Verdict):
                return found
            size = len(found[1])
        if rules.min_body_size is not None and size < rules.min_body_size:
            return Verdict("ban", "small_body")
        if ratio and site is not None:
            if self._smaller_than_usual(site, size, ratio):
                return Verdict("ban", "small_body")
            self._record_size(site, size)
        return FINE

    def required_selectors(self, request: Request, response: Response,
                           required_css: Sequence[str] | None = None) -> tuple[str, ...]:
        """The selectors a page of ``response`` must hold (as ``response_verdict`` checks them), and of
        those, the ones it lacks (checked again: for the log line of a suspect content check only)."""
        site = _site_or_none(response.url or request.url)
        rules = self.site_rules.get(site, _NO_RULES) if site else _NO_RULES
        return self._selectors_for(rules, required_css)

    def _selectors_for(self, rules: SiteContentRules, override: Sequence[str] | None) -> tuple[str, ...]:
        """Precedence: explicit argument (meta / spider, even empty) → the site's rule → the global."""
        if override is not None:
            return css_tuple(override, "required_css")
        return rules.required_css or self.required_css

    def _html_page(self, request: Request, response: Response) -> HtmlResponse | Verdict:
        """The page as the spider will see it (decoded), or the verdict when there is no page to check."""
        if isinstance(response, HtmlResponse) and not response.headers.get(b"Content-Encoding"):
            return response  # already plain; its cached selector will serve the spider too
        found = self._html_body(request, response)
        if isinstance(found, Verdict):
            return found
        cls, body = found
        headers = response.headers.copy()
        headers.pop(b"Content-Encoding", None)
        return cls(url=response.url, status=response.status, headers=headers, body=body)

    def _html_body(self, request: Request, response: Response) -> tuple[type[HtmlResponse], bytes] | Verdict:
        """The HTML class and decoded body of the page, or the verdict when there is no page to check.

        Not HTML (images, JSON, robots.txt...) → ``FINE``: content rules describe pages, and a site's
        small text files must not count as small pages. Undecodable → ``UNKNOWN``. The class is guessed
        as Scrapy guesses it once the body is decoded, from the headers first, so a body is decoded only
        when it may be HTML.
        """
        encodings = response.headers.getlist(b"Content-Encoding")
        if not encodings and isinstance(response, HtmlResponse):
            return type(response), response.body
        # What Scrapy will guess once the body is decoded (a Content-Encoding makes it guess Response)
        headers = {name: response.headers[name] for name in _TYPE_HEADERS if name in response.headers}
        cls = responsetypes.from_args(headers=headers, url=response.url)
        if cls is not Response and not issubclass(cls, HtmlResponse):
            return FINE
        max_size = request.meta.get("download_maxsize", self.max_decoded_size)
        body = decode_body(response.body, encodings, max_size=max_size) if encodings else response.body
        if body is None:
            return UNKNOWN
        if cls is Response:
            cls = responsetypes.from_args(headers=headers, url=response.url, body=body)
            if not issubclass(cls, HtmlResponse):
                return FINE
        return cls, body

    # --- learned page sizes ------------------------------------------------------------------------

    def _smaller_than_usual(self, site: str, size: int, ratio: float) -> bool:
        """True when enough good pages were seen and this one is under ``ratio`` times their median."""
        sizes = self._sizes.get(site)
        if sizes is None or len(sizes) < self.small_body_min_samples:
            return False
        return size < ratio * statistics.median(sizes)

    def _record_size(self, site: str, size: int) -> None:
        """Remember a good page's size; only pages judged fine, so bans cannot drag the median down."""
        sizes = self._sizes.get(site)
        if sizes is None:
            if len(self._sizes) >= self.max_tracked_sites:
                del self._sizes[next(iter(self._sizes))]
            sizes = self._sizes[site] = deque(maxlen=self.small_body_window)
        sizes.append(size)

    def usual_body_size(self, site: str) -> float | None:
        """The median decoded size of recent good pages of a site (for reporting), or ``None``."""
        sizes = self._sizes.get(registrable_domain(site))
        return statistics.median(sizes) if sizes else None

    # --- exceptions ----------------------------------------------------------------------------

    def exception_verdict(self, request: Request, exception: BaseException | Failure) -> Verdict:
        """Transport failures mean the proxy is failing (``dead``); anything else is ``unknown``."""
        if isinstance(exception, Failure):
            exception = exception.value
        for types, reason in self.exception_reasons:
            if types and isinstance(exception, types):
                return Verdict("dead", reason)
        return UNKNOWN


# --- Retry-After ----------------------------------------------------------------------------------

def retry_after_seconds(response: Response, now: float | None = None) -> float | None:
    """A response's ``Retry-After`` (RFC 9110 10.2.3) in seconds from now, or ``None`` when it has none
    or it cannot be read (a ban then gets the usual quarantine, never an error).

    Delay-seconds (``120``) is taken as is; an HTTP date counts from the response's ``Date`` header
    when it has one (the server's own clock, so host clock skew does not matter), else from ``now``
    (default: this host's clock). A date in the past is 0.
    """
    raw = response.headers.get(b"Retry-After")
    if not raw:
        return None
    text = raw.decode("latin-1").strip()
    if text.isascii() and text.isdigit():  # not str.isdigit alone: "²" is a digit to it, not to int()
        return float(int(text))
    when = _http_date(text)
    if when is None:
        return None
    date = response.headers.get(b"Date")
    base = _http_date(date.decode("latin-1").strip()) if date else None
    if base is None:
        base = time.time() if now is None else now
    return max(0.0, when - base)


def _http_date(text: str) -> float | None:
    try:
        parsed = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if parsed is None:
        return None
    if parsed.tzinfo is None:  # RFC 850 / asctime forms carry no zone: GMT by definition
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


# --- URL matching ----------------------------------------------------------------------------------

def _navigated(request: Request, response: Response) -> bool:
    """The page answered is not the one asked for: a redirect was followed (Scrapy's and
    scrapy-playwright's both set ``redirect_urls``), or a browser page moved on by itself (a script's
    ``location = '/captcha'``, a meta refresh: scrapy-playwright's response carries the page's final URL)."""
    if request.meta.get("redirect_urls"):
        return True
    return "playwright" in response.flags and response.url.split("#", 1)[0] != request.url.split("#", 1)[0]


def redirect_target(base_url: str, location: bytes | str) -> str:
    """The absolute URL a ``Location`` header points to, resolved as Scrapy's redirect does."""
    return urljoin(base_url, safe_url_string(location))


def url_matches(url: str, patterns: Sequence[re.Pattern[str]]) -> bool:
    """Whether any pattern occurs in the URL's host or in its path + query (never the fragment)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    path_query = parts.path + (f"?{parts.query}" if parts.query else "")
    return any(p.search(host) or p.search(path_query) for p in patterns)


#: The headers Scrapy's response-class guess reads besides Content-Encoding (responsetypes.from_headers).
_TYPE_HEADERS = (b"Content-Type", b"Content-Disposition")


def _site_or_none(url: str) -> str | None:
    """The URL's registrable domain, or ``None`` for URLs without a host (data:, file:)."""
    try:
        return site_of_url(url)
    except ValueError:
        return None
