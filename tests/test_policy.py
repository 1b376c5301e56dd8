"""BanPolicy: every branch of response_verdict / exception_verdict, body decoding, settings parsing.

Pure and fast: Requests and Responses are built with scrapy.http, nothing touches the network.
"""

from __future__ import annotations

import gzip
import re
import zlib

import brotli
import pytest
from scrapy.core.downloader.handlers.http11 import TunnelError
from scrapy.exceptions import IgnoreRequest
from scrapy.http import HtmlResponse, Request, Response, TextResponse
from scrapy.settings import Settings
from scrapy.utils.test import get_crawler
from twisted.internet import defer
from twisted.internet import error as tx_error
from twisted.python.failure import Failure
from twisted.web._newclient import ResponseFailed, ResponseNeverReceived

from scrapy_proxy_shard.crawl import decoding
from scrapy_proxy_shard.exceptions import SettingError
from scrapy_proxy_shard.policy import (
    DEFAULT_CHALLENGE_PATTERNS,
    EXCEPTION_REASONS,
    FINE,
    UNKNOWN,
    BanPolicy,
    SiteContentRules,
    Verdict,
)

URL = "https://shop.example.com/catalog/1"


def page(items: int = 20, *, marker: str = '<div id="products">') -> bytes:
    """A product page: big enough to set the usual size, with the content selectors look for."""
    rows = "".join(f"<li class='item'>Item {i} with a description long enough</li>" for i in range(items))
    return f"<html><head><title>Catalog</title></head><body>{marker}<ul>{rows}</ul></div></body></html>".encode()


STUB = b"<html><body><p>Please wait...</p></body></html>"


def html(body: bytes = b"", *, url: str = URL, status: int = 200, encoding: str | None = None,
         headers: dict | None = None) -> HtmlResponse:
    hdrs = {"Content-Type": "text/html; charset=utf-8", **(headers or {})}
    if encoding:
        hdrs["Content-Encoding"] = encoding
    return HtmlResponse(url=url, status=status, headers=hdrs, body=body or page())


def req(url: str = URL, **meta) -> Request:
    return Request(url, meta=meta)


def verdict(policy: BanPolicy, response: Response, request: Request | None = None, **kwargs) -> Verdict:
    return policy.response_verdict(request or req(response.url), response, **kwargs)


# --- Verdict ---------------------------------------------------------------------------------------

def test_verdict_constants_and_validation():
    assert Verdict("fine") == FINE and Verdict("unknown") == UNKNOWN
    with pytest.raises(ValueError, match="kind 'banned'"):
        Verdict("banned")
    with pytest.raises(ValueError, match="reason 'HTTP 403'"):
        Verdict("ban", "HTTP 403")


# --- status codes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [403, 429, 503])
def test_each_default_ban_code_is_a_ban(status):
    assert verdict(BanPolicy(), html(status=status)) == Verdict("ban", f"http_{status}")


def test_proxy_auth_failure_is_a_dead_proxy_even_if_listed_as_ban_code():
    policy = BanPolicy(ban_codes=(403, 407))
    assert verdict(policy, html(status=407)) == Verdict("dead", "proxy_auth")
    assert verdict(BanPolicy(proxy_failure_codes=(407, 502)), html(status=502)) == Verdict("dead", "proxy_http_502")


@pytest.mark.parametrize("status", [404, 410, 500, 502])
def test_other_error_statuses_are_unknown(status):
    assert verdict(BanPolicy(), html(status=status)) == UNKNOWN


# --- redirects and challenge pages ----------------------------------------------------------------

@pytest.mark.parametrize(
    "location",
    [
        "https://shop.example.com/captcha?return=%2Fcatalog%2F1",  # absolute
        "/captcha?return=%2Fcatalog%2F1",  # relative to the response URL
        "../cdn-cgi/challenge-platform/h/b",
        "https://geo.captcha-delivery.com/interstitial/",  # pattern in the host
        "/sorry/index?continue=x",
        "/account/login?next=/catalog/1",
        "/Are-You-Human",  # case-insensitive
    ],
)
def test_redirect_to_a_challenge_is_a_ban(location):
    response = Response(URL, status=302, headers={"Location": location})
    assert verdict(BanPolicy(), response) == Verdict("ban", "challenge_redirect")


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_ordinary_redirect_is_unknown_so_the_redirect_middleware_follows_it(status):
    response = Response(URL, status=status, headers={"Location": "/catalog/2"})
    assert verdict(BanPolicy(), response) == UNKNOWN


def test_redirect_without_location_is_unknown():
    assert verdict(BanPolicy(), Response(URL, status=304)) == UNKNOWN


def test_fragment_is_not_searched():
    response = Response(URL, status=302, headers={"Location": "/catalog/2#login"})
    assert verdict(BanPolicy(), response) == UNKNOWN


def test_challenge_page_reached_through_a_redirect_is_a_ban():
    captcha = html(b"<html><body><form>verify you are human</form></body></html>",
                   url="https://shop.example.com/captcha?return=%2Fcatalog%2F1")
    request = req(captcha.url, redirect_urls=[URL])
    assert verdict(BanPolicy(), captcha, request) == Verdict("ban", "challenge_page")


def test_a_browser_page_that_moved_to_a_challenge_by_itself_is_a_ban():
    # scrapy-playwright: a script sent the page to the captcha (no HTTP redirect, no redirect_urls);
    # the response carries the page's final URL.
    captcha = HtmlResponse(url="https://shop.example.com/captcha?return=%2Fcatalog%2F1", body=page(),
                           headers={"Content-Type": "text/html"}, flags=["playwright"])
    assert verdict(BanPolicy(), captcha, req(URL)) == Verdict("ban", "challenge_page")
    plain = HtmlResponse(url=captcha.url, body=page(), headers={"Content-Type": "text/html"})
    assert verdict(BanPolicy(), plain, req(URL)) == FINE  # not a browser page: the URL is the one asked for
    stayed = HtmlResponse(url=URL, body=page(), headers={"Content-Type": "text/html"}, flags=["playwright"])
    assert verdict(BanPolicy(), stayed, req(URL)) == FINE


def test_challenge_url_requested_directly_is_not_a_ban():
    # The spider asked for the login page itself: nothing sent it there.
    login = html(url="https://shop.example.com/login")
    assert verdict(BanPolicy(), login, req(login.url)) == FINE


# --- required CSS ----------------------------------------------------------------------------------

def test_missing_required_css_on_a_plain_body_is_a_ban():
    policy = BanPolicy(required_css=("#products", "li.item"))
    assert verdict(policy, html(STUB)) == Verdict("ban", "missing_css")
    assert verdict(policy, html(page())) == FINE


def test_compressed_bodies_are_decoded_before_content_checks():
    policy = BanPolicy(required_css=("#products",))
    assert verdict(policy, html(gzip.compress(STUB), encoding="gzip")) == Verdict("ban", "missing_css")
    assert verdict(policy, html(gzip.compress(page()), encoding="gzip")) == FINE
    assert verdict(policy, html(brotli.compress(STUB), encoding="br")) == Verdict("ban", "missing_css")
    assert verdict(policy, html(brotli.compress(page()), encoding="br")) == FINE


def test_a_compressed_page_that_scrapy_built_as_a_plain_response_is_still_checked():
    policy = BanPolicy(required_css=("#products",))
    response = Response(URL, headers={"Content-Encoding": "gzip"}, body=gzip.compress(STUB))  # no Content-Type
    assert verdict(policy, response) == Verdict("ban", "missing_css")


def test_selectors_see_the_charset_of_the_decoded_page():
    body = '<html><head><meta charset="cp1251"></head><body><h1>Каталог</h1></body></html>'.encode("cp1251")
    response = HtmlResponse(URL, headers={"Content-Type": "text/html", "Content-Encoding": "gzip"},
                            body=gzip.compress(body))
    policy = BanPolicy(required_css=("h1:contains('Каталог')",))
    assert verdict(policy, response) == FINE


def test_required_css_argument_overrides_site_and_global_even_when_empty():
    policy = BanPolicy(required_css=("#products",),
                       site_rules={"example.com": SiteContentRules(required_css=("li.item",))})
    assert verdict(policy, html(STUB), required_css=()) == FINE
    assert verdict(policy, html(STUB), required_css=["p"]) == FINE
    assert verdict(policy, html(page()), required_css="p") == Verdict("ban", "missing_css")  # one selector


def test_invalid_css_argument_names_the_selector():
    with pytest.raises(ValueError, match=r"invalid CSS selector 'div\['"):
        verdict(BanPolicy(), html(), required_css=["div["])


def test_css_is_not_applied_to_non_html_responses():
    policy = BanPolicy(required_css=("#products",))
    json_response = TextResponse(URL, headers={"Content-Type": "application/json"}, body=b'{"ok": true}')
    assert verdict(policy, json_response) == FINE
    image = Response("https://shop.example.com/a.png", headers={"Content-Type": "image/png"},
                     body=b"\x89PNG\r\n\x1a\n")
    assert verdict(policy, image) == FINE


def test_head_requests_and_bodyless_statuses_are_fine():
    policy = BanPolicy(required_css=("#products",))
    assert policy.response_verdict(Request(URL, method="HEAD"), html(b" ")) == FINE
    assert verdict(policy, html(b" ", status=204)) == FINE


def test_url_without_host_gets_global_rules_only():
    response = HtmlResponse("data:text/html,<p>hi</p>", body=b"<p>hi</p>")
    assert verdict(BanPolicy(small_body_min_samples=1), response) == FINE
    assert verdict(BanPolicy(required_css=("#products",)), response) == Verdict("ban", "missing_css")


# --- per-site rules ------------------------------------------------------------------------------

def test_site_rules_are_keyed_by_registrable_domain():
    rules = SiteContentRules(required_css=("#products",), ban_codes=frozenset({404}),
                             challenge_patterns=(re.compile("/interstitial"),))
    policy = BanPolicy(site_rules={"www.example.com": rules})
    assert verdict(policy, html(STUB, url="https://m.example.com/x")) == Verdict("ban", "missing_css")
    assert verdict(policy, html(STUB, url="https://other.example.org/x")) == FINE
    # The site's ban codes and patterns replace the global ones.
    assert verdict(policy, html(status=404)) == Verdict("ban", "http_404")
    assert verdict(policy, html(status=403)) == UNKNOWN
    to_login = Response(URL, status=302, headers={"Location": "/login"})
    assert verdict(policy, to_login) == UNKNOWN
    to_interstitial = Response(URL, status=302, headers={"Location": "/interstitial"})
    assert verdict(policy, to_interstitial) == Verdict("ban", "challenge_redirect")


# --- small bodies --------------------------------------------------------------------------------

def test_small_body_below_site_floor_is_a_ban():
    policy = BanPolicy(site_rules={"example.com": SiteContentRules(min_body_size=500)})
    assert verdict(policy, html(STUB)) == Verdict("ban", "small_body")
    assert verdict(policy, html(gzip.compress(STUB), encoding="gzip")) == Verdict("ban", "small_body")
    assert verdict(policy, html(page())) == FINE


def test_small_body_against_learned_median():
    policy = BanPolicy(small_body_min_samples=10)
    for _ in range(9):
        assert verdict(policy, html(page())) == FINE
    assert verdict(policy, html(STUB)) == FINE  # only 9 samples: not enough to judge
    assert verdict(policy, html(page())) == FINE
    assert policy.usual_body_size("shop.example.com") == len(page())
    assert verdict(policy, html(STUB)) == Verdict("ban", "small_body")
    assert verdict(policy, html(gzip.compress(STUB), encoding="gzip")) == Verdict("ban", "small_body")
    assert verdict(policy, html(page(5))) == FINE  # smaller but above ratio x median
    assert verdict(policy, html(STUB, url="https://other.example.org/")) == FINE  # per site


def test_only_fine_pages_feed_the_median():
    policy = BanPolicy(required_css=("#products",), small_body_min_samples=2)
    for _ in range(5):
        assert verdict(policy, html(STUB)) == Verdict("ban", "missing_css")
    assert policy.usual_body_size("example.com") is None


def test_ratio_zero_disables_the_learned_rule():
    policy = BanPolicy(small_body_ratio=0, small_body_min_samples=1)
    for _ in range(10):
        verdict(policy, html(page()))
    assert verdict(policy, html(STUB)) == FINE
    assert policy.usual_body_size("example.com") is None

    per_site = BanPolicy(small_body_min_samples=1, site_rules={"example.com": SiteContentRules(min_body_ratio=0)})
    verdict(per_site, html(page()))
    assert verdict(per_site, html(STUB)) == FINE


def test_site_ratio_overrides_global():
    policy = BanPolicy(small_body_min_samples=1, site_rules={"example.com": SiteContentRules(min_body_ratio=0.9)})
    verdict(policy, html(page(20)))
    assert verdict(policy, html(page(10))) == Verdict("ban", "small_body")


def test_learned_sizes_are_bounded():
    policy = BanPolicy(small_body_min_samples=1)
    policy.max_tracked_sites = 2
    for host in ("a.example", "b.example", "c.example"):
        verdict(policy, html(url=f"https://{host}/"))
    assert policy.usual_body_size("a.example") is None
    assert policy.usual_body_size("c.example") == len(page())


# --- undecodable bodies --------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("body", "encoding"),
    [
        (b"this is not gzip at all", "gzip"),
        (b"not brotli either \x00\xff", "br"),
        (page(), "compress"),  # a coding nobody decodes
    ],
)
def test_undecodable_body_is_unknown_not_a_crash(body, encoding):
    policy = BanPolicy(required_css=("#products",))
    assert verdict(policy, html(body, encoding=encoding)) == UNKNOWN


def test_decoding_past_the_size_limit_is_unknown():
    bomb = gzip.compress(b"<html>" + b" " * 200_000)
    assert verdict(BanPolicy(max_decoded_size=100_000), html(bomb, encoding="gzip")) == UNKNOWN
    assert verdict(BanPolicy(), html(bomb, encoding="gzip"), req(download_maxsize=1000)) == UNKNOWN


def test_no_content_rules_means_no_decoding():
    policy = BanPolicy(small_body_ratio=0)
    assert verdict(policy, html(b"garbage", encoding="gzip")) == FINE


# --- decoding ----------------------------------------------------------------------------------

def test_decode_body_codings():
    text = page()
    assert decoding.decode_body(gzip.compress(text), [b"gzip"]) == text
    assert decoding.decode_body(gzip.compress(text), [b"x-gzip"]) == text
    assert decoding.decode_body(zlib.compress(text), [b"deflate"]) == text
    raw = zlib.compressobj(wbits=-15)
    assert decoding.decode_body(raw.compress(text) + raw.flush(), [b"deflate"]) == text  # raw deflate
    assert decoding.decode_body(brotli.compress(text), ["br"]) == text
    assert decoding.decode_body(text, [b"identity"]) == text


def test_decode_body_undoes_several_codings_last_first():
    text = page()
    body = brotli.compress(gzip.compress(text))
    assert decoding.decode_body(body, [b"gzip, br"]) == text
    assert decoding.decode_body(body, [b"gzip", b"br"]) == text  # two headers
    assert decoding.decode_body(body, [b"br, gzip"]) is None


def test_decode_body_concatenated_gzip_members_and_large_bodies():
    big = b"x" * 300_000 + page()
    assert decoding.decode_body(gzip.compress(big) + gzip.compress(b"tail"), [b"gzip"]) == big + b"tail"
    assert decoding.decode_body(gzip.compress(big), [b"gzip"], max_size=1000) is None
    assert decoding.decode_body(brotli.compress(big), [b"br"], max_size=1000) is None


def test_decode_body_keeps_what_a_truncated_gzip_stream_held():
    big = page(2000)
    truncated = gzip.compress(big)[:-100]
    decoded = decoding.decode_body(truncated, [b"gzip"])
    assert decoded and big.startswith(decoded)
    assert decoding.decode_body(gzip.compress(big)[:5], [b"gzip"]) is None


def test_decode_body_zstd():
    if "zstd" not in decoding.supported_encodings():
        pytest.skip("no zstd codec installed")
    try:
        from compression import zstd
    except ImportError:
        from backports import zstd
    text = page()
    assert decoding.decode_body(zstd.compress(text), [b"zstd"]) == text
    assert decoding.decode_body(b"not zstd", [b"zstd"]) is None


# --- exceptions ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("exception", "reason"),
    [
        (tx_error.ConnectionRefusedError(), "connection_refused"),
        (tx_error.TCPTimedOutError(), "timeout"),
        (tx_error.TimeoutError(), "timeout"),
        (defer.TimeoutError(), "timeout"),
        (tx_error.ConnectionLost(), "connection_lost"),
        (tx_error.ConnectionDone(), "connection_lost"),
        (ResponseNeverReceived([Failure(tx_error.ConnectionLost())]), "connection_lost"),
        (ResponseFailed([Failure(tx_error.ConnectionLost())]), "connection_lost"),
        (tx_error.ConnectError(), "connect_error"),
        (tx_error.SSLError(), "connect_error"),
        (tx_error.DNSLookupError(), "dns"),
        (TunnelError("Could not open CONNECT tunnel with proxy 10.0.0.1:3128"), "tunnel_error"),
    ],
)
def test_transport_failures_mean_a_dead_proxy(exception, reason):
    assert BanPolicy().exception_verdict(req(), exception) == Verdict("dead", reason)
    assert BanPolicy().exception_verdict(req(), Failure(exception)) == Verdict("dead", reason)


def test_scrapy_wrapped_download_errors_are_mapped_too():
    exceptions = pytest.importorskip("scrapy.exceptions")
    if not hasattr(exceptions, "DownloadTimeoutError"):
        pytest.skip("Scrapy < 2.14 raises the Twisted errors directly")
    policy = BanPolicy()
    assert policy.exception_verdict(req(), exceptions.DownloadTimeoutError()) == Verdict("dead", "timeout")
    assert policy.exception_verdict(req(), exceptions.DownloadConnectionRefusedError()).reason == "connection_refused"
    assert policy.exception_verdict(req(), exceptions.CannotResolveHostError()).reason == "dns"
    assert policy.exception_verdict(req(), exceptions.DownloadFailedError()).reason == "connection_lost"
    assert policy.exception_verdict(req(), exceptions.ResponseDataLossError()).reason == "connection_lost"


@pytest.mark.parametrize("exception", [IgnoreRequest(), ValueError("spider bug"), KeyError("x")])
def test_other_exceptions_are_unknown(exception):
    assert BanPolicy().exception_verdict(req(), exception) == UNKNOWN


def test_exception_mapping_is_extensible():
    class FlakyProxy(Exception):
        pass

    class MyPolicy(BanPolicy):
        exception_reasons = (((FlakyProxy,), "flaky"), *EXCEPTION_REASONS)

    assert MyPolicy().exception_verdict(req(), FlakyProxy()) == Verdict("dead", "flaky")
    assert MyPolicy().exception_verdict(req(), tx_error.DNSLookupError()) == Verdict("dead", "dns")


# --- settings --------------------------------------------------------------------------------------

def from_settings(**values) -> BanPolicy:
    return BanPolicy.from_settings(Settings(values))


def test_defaults_from_crawler():
    policy = BanPolicy.from_crawler(get_crawler(settings_dict={}))
    assert policy.ban_codes == {403, 429, 503}
    assert policy.proxy_failure_codes == {407}
    assert [p.pattern for p in policy.challenge_patterns] == [p.pattern for p in DEFAULT_CHALLENGE_PATTERNS]
    assert policy.required_css == ()
    assert policy.small_body_ratio == 0.2 and policy.small_body_min_samples == 10
    assert policy.max_decoded_size == 1024 * 1024 * 1024  # DOWNLOAD_MAXSIZE
    assert policy.site_rules == {}


def test_settings_accept_lists_and_comma_separated_codes():
    policy = from_settings(
        PROXY_SHARD_BAN_CODES="403, 429,520",
        PROXY_SHARD_PROXY_FAILURE_CODES=[407, "502"],
        PROXY_SHARD_CHALLENGE_PATTERNS=r"/x{1,3}/",  # one regex: commas are regex syntax
        PROXY_SHARD_REQUIRED_CSS="#main, #content",  # one selector: commas are CSS syntax
        PROXY_SHARD_SMALL_BODY_RATIO="0",
        PROXY_SHARD_SMALL_BODY_MIN_SAMPLES="3",
    )
    assert policy.ban_codes == {403, 429, 520}
    assert policy.proxy_failure_codes == {407, 502}
    assert [p.pattern for p in policy.challenge_patterns] == [r"/x{1,3}/"]
    assert policy.required_css == ("#main, #content",)
    assert policy.small_body_ratio == 0 and policy.small_body_min_samples == 3


def test_site_settings_build_content_rules():
    policy = from_settings(PROXY_SHARD_SITES={
        "www.shop.co.uk": {
            "concurrency": 2, "min_interval": 3,  # lease-engine options: ignored here
            "required_css": ["#products"], "min_body_size": 2000, "min_body_ratio": 0.5,
            "ban_codes": [403, 404], "challenge_patterns": ["/interstitial"],
        },
        "pacing-only.example": {"concurrency": 4},
    })
    rules = policy.site_rules["shop.co.uk"]
    assert rules.required_css == ("#products",)
    assert rules.min_body_size == 2000 and rules.min_body_ratio == 0.5
    assert rules.ban_codes == {403, 404}
    assert [p.pattern for p in rules.challenge_patterns] == ["/interstitial"]
    assert "pacing-only.example" not in policy.site_rules
    assert verdict(policy, html(STUB, url="https://shop.co.uk/p")) == Verdict("ban", "missing_css")


def test_plain_mapping_settings_keep_the_default_size_limit():
    policy = BanPolicy.from_settings({"PROXY_SHARD_BAN_CODES": [403]})
    assert policy.ban_codes == {403} and policy.max_decoded_size == BanPolicy().max_decoded_size
    with pytest.raises(SettingError, match="must be a Scrapy Settings object or a mapping"):
        BanPolicy.from_settings(["PROXY_SHARD_BAN_CODES"])


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PROXY_SHARD_SITES", {"": {"min_body_size": 1}}, r"PROXY_SHARD_SITES: invalid site ''"),
        ("PROXY_SHARD_BAN_CODES", [403, 700], r"PROXY_SHARD_BAN_CODES \(\[403, 700\]\) must be a list of HTTP status"),
        ("PROXY_SHARD_BAN_CODES", "403,abc", r"PROXY_SHARD_BAN_CODES \('403,abc'\)"),
        ("PROXY_SHARD_BAN_CODES", [True], r"PROXY_SHARD_BAN_CODES \(\[True\]\)"),
        ("PROXY_SHARD_BAN_CODES", 403, r"PROXY_SHARD_BAN_CODES \(403\)"),
        ("PROXY_SHARD_PROXY_FAILURE_CODES", [99], r"PROXY_SHARD_PROXY_FAILURE_CODES \(\[99\]\)"),
        ("PROXY_SHARD_CHALLENGE_PATTERNS", ["ok", "(unclosed"],
         r"PROXY_SHARD_CHALLENGE_PATTERNS: invalid regular expression '\(unclosed'"),
        ("PROXY_SHARD_CHALLENGE_PATTERNS", [""], r"PROXY_SHARD_CHALLENGE_PATTERNS: '' must be a non-empty"),
        ("PROXY_SHARD_CHALLENGE_PATTERNS", 5, r"PROXY_SHARD_CHALLENGE_PATTERNS \(5\) must be a list"),
        ("PROXY_SHARD_REQUIRED_CSS", ["#ok", "div["], r"PROXY_SHARD_REQUIRED_CSS: invalid CSS selector 'div\['"),
        ("PROXY_SHARD_REQUIRED_CSS", [3], r"PROXY_SHARD_REQUIRED_CSS: 3 must be a non-empty CSS selector"),
        ("PROXY_SHARD_SMALL_BODY_RATIO", 1, r"PROXY_SHARD_SMALL_BODY_RATIO \(1\) must be >= 0 and < 1"),
        ("PROXY_SHARD_SMALL_BODY_RATIO", -0.1, r"PROXY_SHARD_SMALL_BODY_RATIO \(-0.1\) must be >= 0"),
        ("PROXY_SHARD_SMALL_BODY_RATIO", "half", r"PROXY_SHARD_SMALL_BODY_RATIO \('half'\) must be a number"),
        ("PROXY_SHARD_SMALL_BODY_MIN_SAMPLES", 0, r"PROXY_SHARD_SMALL_BODY_MIN_SAMPLES \(0\) must be >= 1"),
        ("PROXY_SHARD_SMALL_BODY_MIN_SAMPLES", 2.5, r"PROXY_SHARD_SMALL_BODY_MIN_SAMPLES \(2.5\) must be a whole"),
        ("PROXY_SHARD_SITES", {"a.example": 5}, r"PROXY_SHARD_SITES\['a.example'\] \(5\) must be a dict"),
        ("PROXY_SHARD_SITES", {"a.example": {"min_body_size": -1}},
         r"PROXY_SHARD_SITES\['a.example'\].min_body_size \(-1\) must be >= 0"),
        ("PROXY_SHARD_SITES", {"a.example": {"min_body_ratio": 2}},
         r"PROXY_SHARD_SITES\['a.example'\].min_body_ratio \(2\) must be >= 0 and < 1"),
        ("PROXY_SHARD_SITES", {"a.example": {"ban_codes": ["x"]}},
         r"PROXY_SHARD_SITES\['a.example'\].ban_codes \(\['x'\]\)"),
        ("PROXY_SHARD_SITES", {"a.example": {"challenge_patterns": ["["]}},
         r"PROXY_SHARD_SITES\['a.example'\].challenge_patterns: invalid regular expression '\['"),
        ("PROXY_SHARD_SITES", {"a.example": {"required_css": ["a:nope"]}},
         r"PROXY_SHARD_SITES\['a.example'\].required_css: invalid CSS selector 'a:nope'"),
    ],
)
def test_bad_settings_name_the_setting_and_value(name, value, message):
    with pytest.raises(SettingError, match=message):
        from_settings(**{name: value})


@pytest.mark.parametrize(("headers", "expected"), [
    ({"Retry-After": "120"}, 120.0),
    ({"Retry-After": " 0 "}, 0.0),
    ({"Retry-After": "Wed, 21 Oct 2026 07:28:42 GMT", "Date": "Wed, 21 Oct 2026 07:28:00 GMT"}, 42.0),
    ({"Retry-After": "Wednesday, 21-Oct-26 07:28:42 GMT", "Date": "Wed, 21 Oct 2026 07:28:00 GMT"}, 42.0),
    ({"Retry-After": "Wed, 21 Oct 2026 07:27:00 GMT", "Date": "Wed, 21 Oct 2026 07:28:00 GMT"}, 0.0),  # past
    ({"Retry-After": "Wed, 21 Oct 2026 07:28:42 GMT"}, 12.0),  # no Date: from `now`
    ({"Retry-After": "-5"}, None),
    ({"Retry-After": "1.5"}, None),  # RFC 9110: delay-seconds is a non-negative integer
    ({"Retry-After": "tomorrow"}, None),
    ({"Retry-After": "\u00b2".encode("latin-1")}, None),  # a digit to str.isdigit, not to int()
    ({}, None),
])
def test_retry_after_seconds_reads_both_forms_and_ignores_the_rest(headers, expected):
    from datetime import datetime, timezone

    from scrapy_proxy_shard.policy import retry_after_seconds

    now = datetime(2026, 10, 21, 7, 28, 30, tzinfo=timezone.utc).timestamp()
    response = Response("http://shop.example/", status=429, headers=headers)
    got = retry_after_seconds(response, now=now)
    assert got == (pytest.approx(expected) if expected is not None else None)
