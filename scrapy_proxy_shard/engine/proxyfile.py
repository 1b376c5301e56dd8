"""Proxy list files: one proxy per line, or CSV with a header, validated line by line.

Two formats, told apart by the first line that is neither blank nor a ``#`` comment:

- plain: one proxy per line in any form ``parse_proxy`` accepts (``scheme://user:pass@host:port``,
  ``host:port``, ``host:port:user:pass``), or a gateway entry (``<template>#sessions=N``, whose line
  gives N pool members, see ``engine/gateway.py``); a note may follow an entry after blanks and ``#``;
- CSV: a header naming the columns, ``url`` first, then any of ``type``, ``provider``, ``country``
  (tags shown by ``list`` and kept with the proxy), e.g. ``url,type,provider,country``.

Every bad line is reported with its number, so an operator fixes a file in one pass instead of one
error per attempt; the caller decides whether anything is loaded from a file with errors. Lines of
one exit (``host:port`` and a declared ``#session=``: see ``engine/exits.py``) are merged, the later
line's URL and tags winning; a later line with other credentials or scheme is reported in
``replaced`` (masked). Error messages show entries masked: a typo in a line never prints its password.

One parser for every list file: the CLI's ``load FILE`` and the crawl's ``PROXY_SHARD_PROXIES_PATH``
(settings.py) read a file alike (``read_proxy_file``), so a file one accepts the other accepts. It lives
in the engine layer (no Scrapy) so that settings.py can use it; ``ops.proxyfile`` re-exports it.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass, field

from scrapy_proxy_shard.engine.exits import merge_exits
from scrapy_proxy_shard.engine.gateway import expand_entry, mask_entry
from scrapy_proxy_shard.engine.proxies import Proxy
from scrapy_proxy_shard.exceptions import ProxyURLError

COLUMNS = ("url", "type", "provider", "country")
_COUNTRY_RE = re.compile(r"^[A-Za-z]{2}$")
_PROVIDER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._\-]{0,63}$")


@dataclass(frozen=True)
class LineError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass
class ProxyList:
    """What a file held: valid proxies (one per exit), bad lines, how many lines were merged into an
    earlier one, and a message per line that replaced another line's URL for its exit."""

    proxies: list[Proxy] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    duplicates: int = 0
    replaced: list[str] = field(default_factory=list)


def check_tags(tags: dict[str, str]) -> dict[str, str]:
    """Validate and normalise tags (``type``, ``provider``, ``country``); empty values are dropped."""
    out: dict[str, str] = {}
    for name, raw in tags.items():
        value = (raw or "").strip()
        if not value:
            continue
        if name == "country":
            if not _COUNTRY_RE.match(value):
                raise ProxyURLError(f"country {value!r} must be a two-letter code such as DE")
            value = value.upper()
        elif name == "provider" and not _PROVIDER_RE.match(value):
            raise ProxyURLError(f"provider {value!r} must be 1-64 letters, digits, spaces, '.', '_' or '-'")
        elif name == "type":
            value = value.lower()
        out[name] = value
    return out


#: Where a note after an entry starts: blanks then ``#`` (``#session=`` / ``#sessions=`` marks follow the URL
#: without a blank).
_INLINE_NOTE = re.compile(r"\s+#")


def parse_proxy_list(text: str, *, tags: dict[str, str] | None = None) -> ProxyList:
    """Parse a whole file; ``tags`` apply to every proxy (CSV columns override them)."""
    result = ProxyList()
    parsed: list[tuple[str, Proxy]] = []
    header: list[str] | None = None
    first = True
    for number, raw in enumerate(text.lstrip("\ufeff").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if first:
            first = False
            header = _header(line)
            if header is not None:
                unknown = [c for c in header if c not in COLUMNS]
                if unknown or header[0] != "url" or len(set(header)) != len(header):
                    result.errors.append(LineError(number, (
                        f"CSV header {line!r}: columns are url first, then any of "
                        f"{', '.join(COLUMNS[1:])} (unknown or repeated: {', '.join(unknown) or 'url'})")))
                    return result
                continue
        if header is None:  # a note after an entry: "10.0.0.1:3128  # EU" (a URL has no blank in it)
            line = _INLINE_NOTE.split(line, 1)[0]
        try:
            proxies = _parse_line(line, header, dict(tags or {}))
        except ProxyURLError as exc:
            result.errors.append(LineError(number, str(exc)))
            continue
        parsed.extend((f"line {number}", proxy) for proxy in proxies)
    by_id, result.replaced = merge_exits(parsed)
    result.duplicates = len(parsed) - len(by_id)
    result.proxies = list(by_id.values())
    return result


def decode_proxy_list(data: bytes, name: str) -> str:
    """A list file's bytes as text (UTF-8, a BOM dropped), or ProxyURLError naming the file and the line
    of the first byte that is not UTF-8 (never the line itself: it may hold a password)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ProxyURLError(f"{name}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}): save the file as "
                            "UTF-8") from None


def read_proxy_file(path: str | os.PathLike[str], *, tags: dict[str, str] | None = None) -> ProxyList:
    """Read and parse a list file (``parse_proxy_list``). Raises OSError when it cannot be read (the
    caller names the path and the fix) and ProxyURLError when it is not UTF-8 text."""
    with open(path, "rb") as f:
        data = f.read()
    return parse_proxy_list(decode_proxy_list(data, os.fspath(path)), tags=tags)


def _header(line: str) -> list[str] | None:
    """Column names if ``line`` is a CSV header (its first field is ``url``), else None."""
    fields = [f.strip().lower() for f in next(csv.reader([line]))]
    return fields if fields and fields[0] == "url" else None


def _parse_line(line: str, header: list[str] | None, tags: dict[str, str]) -> list[Proxy]:
    """A line's pool members: one proxy, or a gateway entry's slots (engine/gateway.py)."""
    if header is None:
        return expand_entry(line, check_tags(tags))
    fields = [f.strip() for f in next(csv.reader([line]))]
    if len(fields) > len(header):
        raise ProxyURLError(f"{len(fields)} fields for {len(header)} columns in {mask_entry(line)!r}")
    row = dict(zip(header, fields + [""] * (len(header) - len(fields)), strict=True))
    url = row.pop("url")
    try:
        checked = check_tags({**tags, **{k: v for k, v in row.items() if v}})
    except ProxyURLError as exc:
        raise ProxyURLError(f"proxy {mask_entry(url)!r}: {exc}") from None
    return expand_entry(url, checked)
