"""Proxy URLs: parsing, validation, canonical form, stable ids and credential masking.

A proxy is identified in Redis by a short hash of its canonical URL (``proxy_id``), never by the URL
itself, so credentials cannot leak into key names, SCAN or MONITOR output. Everything a person can
see (logs, stats, errors, CLI) uses ``mask()``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

from .exceptions import ProxyURLError

SUPPORTED_SCHEMES = ("http", "https")
PROXY_TYPES = ("datacenter", "residential", "mobile", "isp")
_HOST_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_IPV4_RE = re.compile(r"^\d{1,3}(?:\.\d{1,3}){3}$")
_URL_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class Proxy:
    """One validated proxy: its canonical URL plus optional tags (type, provider, country…)."""

    url: str
    tags: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def id(self) -> str:
        return proxy_id(self.url)

    @property
    def masked(self) -> str:
        return mask(self.url)

    def __repr__(self) -> str:  # never show credentials, even in a debugger or traceback
        return f"Proxy({self.masked!r}, tags={self.tags!r})"


def proxy_id(canonical_url: str) -> str:
    """Short stable id of a canonical proxy URL (64-bit BLAKE2b, hex)."""
    return hashlib.blake2b(canonical_url.encode(), digest_size=8).hexdigest()


def mask(url: str) -> str:
    """Return ``url`` with user name and password replaced by ``***``.

    Works on anything URL-like, including malformed input, so it is safe to use in error messages.
    """
    if not isinstance(url, str):
        return repr(type(url))
    scheme_end = url.find("://")
    start = scheme_end + 3 if scheme_end >= 0 else 0
    at = url.rfind("@", start)
    if at < 0:
        # host:port:user:pass provider format, or no credentials at all.
        parts = url[start:].split(":")
        if len(parts) >= 4:
            return url[:start] + ":".join(parts[:2]) + ":***:***"
        return url
    userinfo = url[start:at]
    masked_userinfo = "***:***" if ":" in userinfo else "***"
    return url[:start] + masked_userinfo + url[at:]


def parse_proxy(entry: str, *, default_scheme: str = "http") -> str:
    """Validate one proxy entry and return its canonical URL.

    Accepted forms: ``scheme://[user[:pass]@]host:port``, ``[user[:pass]@]host:port`` and the provider
    format ``host:port:user:pass``. Percent-encoded credentials are kept exactly as given (they are
    what the proxy expects); raw special characters in credentials are percent-encoded.

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
    if not _URL_LIKE.match(raw):
        parts = raw.split(":", 3)
        if len(parts) == 4 and parts[1].isdigit() and "@" not in parts[0]:  # host:port:user:pass
            host, port, user, password = parts
            raw = f"{default_scheme}://{_quote_cred(user)}:{_quote_cred(password)}@{host}:{port}"
        else:
            raw = f"{default_scheme}://{raw}"
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
    if _IPV4_RE.match(host):
        if any(int(octet) > 255 for octet in host.split(".")):
            raise ProxyURLError(f"proxy {shown!r}: invalid IPv4 address {host!r}")
    elif ":" in host:  # IPv6 literal (urlsplit removed the brackets)
        host = f"[{host}]"
    elif not _HOST_RE.match(host):
        raise ProxyURLError(f"proxy {shown!r}: invalid host name {host!r}")
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
    return f"{scheme}://{userinfo}{host.lower()}:{port}"


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


def _port_problem(exc: ValueError) -> str:
    text = str(exc)
    if "out of range" in text:
        return "port out of range 1-65535"
    return "port is not a number"
