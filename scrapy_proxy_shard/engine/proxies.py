"""Proxy URLs: parsing, validation, canonical form, stable ids and credential masking.

A proxy is identified in Redis by a short hash of its *exit* (``proxy_id``), never by the URL itself,
so credentials cannot leak into key names, SCAN or MONITOR output. The exit is what a site sees one
IP behind: ``host:port`` (the scheme and the credentials are attributes of an entry, not its
identity: ``http://u:old@h:3128`` and ``https://u:new@h:3128`` are one exit, one slot), plus the
session an entry declares with ``#session=<token>`` (a provider gateway that gives each session its
own IP: ``http://user-session-abc:pw@gw:7777#session=abc``). Everything a person can see (logs,
stats, errors, CLI) uses ``mask()``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

from scrapy_proxy_shard.exceptions import ProxyURLError

SUPPORTED_SCHEMES = ("http", "https")
PROXY_TYPES = ("datacenter", "residential", "mobile", "isp")
_HOST_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_IPV4_RE = re.compile(r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}")
_NUMERIC_HOST_RE = re.compile(r"[0-9.]+")
_URL_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
#: The declared session of a gateway entry: ``#session=<token>`` at the end of the entry.
SESSION_MARK = "#session="
_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~-]{0,63}")
#: A gateway slot's declared session: ``gw.<gid>.<k>[.<token>]`` (no token: a gateway without placeholder).
SLOT_RE = re.compile(r"gw\.([0-9a-f]{8})\.([0-9]{1,5})(?:\.([a-z0-9]{4,32}))?")


@dataclass(frozen=True)
class Proxy:
    """One validated proxy: its canonical URL plus optional tags (type, provider, country…)."""

    url: str
    tags: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def id(self) -> str:
        return proxy_id(self.url)

    @property
    def exit(self) -> str:
        """``host:port`` (``host:port#session``): what one slot stands for."""
        return exit_key(self.url)

    @property
    def masked(self) -> str:
        return mask(self.url)

    def __repr__(self) -> str:  # never show credentials, even in a debugger or traceback
        return f"Proxy({self.masked!r}, tags={self.tags!r})"


def proxy_id(canonical_url: str) -> str:
    """Short stable id of the exit of a canonical proxy URL (64-bit BLAKE2b of ``exit_key``, hex).

    Two entries of one exit (other credentials, the other scheme) have one id: one slot per site."""
    return hashlib.blake2b(exit_key(canonical_url).encode(), digest_size=8).hexdigest()


def exit_key(canonical_url: str) -> str:
    """The exit of a canonical URL (``parse_proxy``'s output): ``host:port``, or ``host:port#session``
    for an entry that declares a gateway session. The scheme and the credentials are not part of it,
    nor is the token of a gateway slot (``#session=gw.<gid>.<k>.<token>``, engine/gateway.py): a
    rotation gives the slot a new exit IP under the same id."""
    address, _, session = canonical_url.partition(SESSION_MARK)
    address = address[address.find("://") + 3:]  # canonical: the scheme is always there
    address = address[address.rfind("@") + 1:]
    if session.startswith("gw."):  # a gateway slot: its exit outlives its token (engine/gateway.py)
        slot = slot_exit(address, session)
        if slot is not None:
            return slot
    return f"{address}#{session}" if session else address


def slot_exit(address: str, session: str) -> str | None:
    """The exit of a gateway slot (engine/gateway.py): the address with the token written ``{session}``
    and the slot without it, or None when ``session`` is not a slot's ``gw.<gid>.<k>[.<token>]``."""
    m = SLOT_RE.fullmatch(session)
    if m is None:
        return None
    token = m.group(3)
    if token:
        address = address.replace(token, "{session}")
    return f"{address}#gw.{m.group(1)}.{m.group(2)}"


def send_url(canonical_url: str) -> str:
    """The URL a request goes through: the canonical URL without its declared session."""
    return canonical_url.partition(SESSION_MARK)[0]


def mask(text: object) -> str:
    """Return a proxy or Redis URL (or any entry a user typed) with every credential replaced by ``***``.

    The one masking function of the package: every error, log line and CLI output that shows a URL
    goes through it. It works on malformed input (that is when it is needed most) and errs towards
    hiding: user info before ``@``, the ``user:pass`` of ``host:port:user:pass``, a ``user:pw`` with
    no host, and query values (``redis://host/0?password=X``) are masked; a scheme, a host and a
    numeric port stay visible so the message still says where, and so does a declared gateway
    session (``#session=<token>``: a name the user picked, not a credential).
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("latin-1")
    if not isinstance(text, str):
        return f"<{type(text).__name__}>"
    head, mark, session = text.rpartition(SESSION_MARK)
    if mark and _SESSION_RE.fullmatch(session):
        return mask(head) + mark + session
    scheme_end = text.find("://")
    start = scheme_end + 3 if scheme_end >= 0 else 0
    head, rest = text[:start], text[start:]
    at = rest.rfind("@")
    if at >= 0:  # everything before the last '@' is user info, whatever characters it holds
        head += ("***:***" if ":" in rest[:at] else "***") + "@"
        rest = rest[at + 1:]
    return head + _mask_address(rest)


def _mask_address(rest: str) -> str:
    """``host[:port][:user[:pass]][/path][?query]`` with the credential parts masked."""
    if rest.startswith("["):  # IPv6 literal
        close = rest.find("]")
        split = close + 1 if close >= 0 else len(rest)
    else:
        split = next((i for i, ch in enumerate(rest) if ch in ":/?#"), len(rest))
    host, after = rest[:split], rest[split:]
    if after.startswith(":"):
        port_end = next((i for i, ch in enumerate(after) if i and ch in ":/?#"), len(after))
        port = after[1:port_end]
        if not (port.isascii() and port.isdigit()):
            return "***" if not host else "***:***"  # `user:pw` with no host, or a garbled port
        host, after = f"{host}:{port}", after[port_end:]
        if after.startswith(":"):  # host:port:user[:pass]: everything after the port is a credential
            return host + (":***:***" if ":" in after[1:] else ":***")
    return host + _mask_tail(after)


def _mask_tail(tail: str) -> str:
    """A path is shown; query values (``?password=X``) and a fragment are masked."""
    path, _, fragment = tail.partition("#")
    path, sep, query = path.partition("?")
    if sep:
        pairs = [f"{pair.partition('=')[0]}=***" if "=" in pair else "***" for pair in query.split("&") if pair]
        path += "?" + "&".join(pairs)
    return path + ("#***" if fragment else "")


def parse_proxy(entry: str, *, default_scheme: str = "http") -> str:
    """Validate one proxy entry and return its canonical URL.

    Accepted forms: ``scheme://[user[:pass]@]host:port``, ``[user[:pass]@]host:port`` and the provider
    format ``host:port:user:pass``, each optionally followed by ``#session=<token>`` (a gateway entry
    whose session has an IP of its own: the token is part of the exit, see ``exit_key``).
    Percent-encoded credentials are kept exactly as given (they are what the proxy expects); raw
    special characters in credentials are percent-encoded. An IPv6 host is written in its compressed
    form (an IPv4-mapped one as the IPv4 address), so one address has one spelling.

    Raises ProxyURLError naming the (masked) entry and the problem.
    """
    if not isinstance(entry, str):
        raise ProxyURLError(f"proxy entry must be a string, got {type(entry).__name__}")
    raw = entry.strip()
    shown = mask(raw)
    if not raw:
        raise ProxyURLError("empty proxy entry")
    if any(ch.isspace() for ch in raw):
        raise ProxyURLError(f"proxy {shown!r}: contains whitespace")
    raw, session = _split_session(raw, shown)
    if not _URL_LIKE.match(raw):
        raw = _provider_form(raw, shown, default_scheme)
    try:
        parts_ = urlsplit(raw)
        port = parts_.port
    except ValueError as exc:
        raise ProxyURLError(f"proxy {shown!r}: {_port_problem(exc)}") from None
    scheme = parts_.scheme.lower()
    if scheme not in SUPPORTED_SCHEMES:
        raise ProxyURLError(
            f"proxy {shown!r}: unsupported scheme {scheme!r} (use one of {', '.join(SUPPORTED_SCHEMES)})"
        )
    host = parts_.hostname or ""
    if not host:
        raise ProxyURLError(f"proxy {shown!r}: missing host")
    host = _check_host(host, shown)
    if port is None:
        raise ProxyURLError(f"proxy {shown!r}: missing port (write host:port)")
    if not 1 <= port <= 65535:
        raise ProxyURLError(f"proxy {shown!r}: port {port} out of range 1-65535")
    if parts_.path not in ("", "/") or parts_.query or parts_.fragment:
        raise ProxyURLError(f"proxy {shown!r}: a proxy URL has no path, query or fragment")
    userinfo = ""
    if parts_.username is not None:
        user = _keep_or_quote(parts_.username)
        if not user:
            raise ProxyURLError(f"proxy {shown!r}: empty user name before '@'")
        userinfo = user
        if parts_.password is not None:
            userinfo += ":" + _keep_or_quote(parts_.password)
        userinfo += "@"
    return f"{scheme}://{userinfo}{host.lower()}:{port}" + (SESSION_MARK + session if session else "")


def _split_session(raw: str, shown: str) -> tuple[str, str]:
    """(entry without its ``#session=<token>`` suffix, token or "")."""
    head, mark, session = raw.rpartition(SESSION_MARK)
    if not mark:
        return raw, ""
    if not _SESSION_RE.fullmatch(session):
        raise ProxyURLError(f"proxy {shown!r}: session {session[:70]!r} must be 1-64 letters, digits, '.', '_', "
                            "'~' or '-' (write #session=<token> at the end of the entry)")
    return head, session


def make_proxy(entry: str, tags: dict[str, str] | None = None) -> Proxy:
    """Validate an entry and its tags into a Proxy."""
    tags = dict(tags or {})
    kind = tags.get("type")
    if kind is not None and kind not in PROXY_TYPES:
        raise ProxyURLError(
            f"proxy {mask(entry)!r}: unknown type {kind!r} (use one of {', '.join(PROXY_TYPES)})"
        )
    return Proxy(parse_proxy(entry), tags)


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """Split a canonical URL into (URL without credentials, user, password), credentials decoded."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    bare = f"{parts.scheme}://{host}:{parts.port}"
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return bare, user, password


def _quote_cred(value: str) -> str:
    return quote(value, safe="!$&'()*+,;=-._~%")


def _keep_or_quote(value: str) -> str:
    """Keep valid percent-encoding untouched; encode characters that are not allowed raw."""
    return _quote_cred(value)


def _provider_form(raw: str, shown: str, scheme: str) -> str:
    """An entry without a scheme as a URL: ``host:port:user:pass`` (provider lists) becomes
    ``scheme://user:pass@host:port``; anything else gets the default scheme in front."""
    parts = raw.split(":", 3)
    if len(parts) >= 3 and "@" not in parts[0] and _is_port(parts[1]):
        if len(parts) == 3 or not parts[2] or not parts[3]:
            raise ProxyURLError(f"proxy {shown!r}: host:port:user:pass needs both a user name and a password "
                                "(or write host:port for a proxy without credentials)")
        host, port, user, password = parts
        return f"{scheme}://{_quote_cred(user)}:{_quote_cred(password)}@{host}:{port}"
    return f"{scheme}://{raw}"


def _check_host(host: str, shown: str) -> str:
    """The host as it goes into the canonical URL, or ProxyURLError.

    One address has one spelling, so one proxy cannot enter the pool twice under two ids: hosts are
    ASCII only (fullwidth digits are refused, not folded), and an IPv4 address is four decimal
    octets without leading zeros (``010.0.0.1`` is octal 8.0.0.1 to some resolvers and 10.0.0.1
    to others). Other all-numeric hosts (``10.1``, ``167772161``) are refused for the same reason.
    """
    if not host.isascii():
        raise ProxyURLError(f"proxy {shown!r}: host {host!r} has non-ASCII characters (write it in ASCII, "
                            "a name in its xn-- form)")
    if _IPV4_RE.fullmatch(host):
        octets = host.split(".")
        if any(int(octet) > 255 for octet in octets):
            raise ProxyURLError(f"proxy {shown!r}: invalid IPv4 address {host!r}")
        if any(len(octet) > 1 and octet.startswith("0") for octet in octets):
            raise ProxyURLError(f"proxy {shown!r}: IPv4 address {host!r} has leading zeros, which some "
                                f"resolvers read as octal: write {'.'.join(str(int(o)) for o in octets)}")
        return host
    if ":" in host:  # IPv6 literal (urlsplit removed the brackets): one spelling per address
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            raise ProxyURLError(f"proxy {shown!r}: invalid IPv6 address {host!r}") from None
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return f"[{address.compressed}]"
    if _NUMERIC_HOST_RE.fullmatch(host):
        raise ProxyURLError(f"proxy {shown!r}: {host!r} is not an IPv4 address (write four numbers a.b.c.d)")
    if not _HOST_RE.fullmatch(host):
        raise ProxyURLError(f"proxy {shown!r}: invalid host name {host!r}")
    return host


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _port_problem(exc: ValueError) -> str:
    text = str(exc)
    if "out of range" in text:
        return "port out of range 1-65535"
    if "IPv6" in text:
        return "invalid IPv6 address between '[' and ']'"
    return "port is not a number (credentials go before '@': scheme://user:pass@host:port)"
