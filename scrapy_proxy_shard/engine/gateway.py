"""Provider gateways: one ``host:port`` whose user name (or password, or host) carries a session token.

Most residential and mobile plans are sold as a gateway: ``user-session-<token>:pw@gw.provider:7777``,
where one token keeps one exit IP for minutes and a new token gets a new one, up to the plan's number
of concurrent sessions. A pool entry declares one as a URL template and a number of sessions::

    http://user-session-{session}:pw@gw.example:7777#sessions=50

and the pool holds 50 *slots* for it. Each slot is an ordinary pool member (exclusivity, pacing, sticky
``meta['session_id']`` all apply per slot and site, as to a static proxy) whose canonical URL is the
template with the slot's token filled in, followed by the slot's mark ``#session=gw.<gid>.<k>.<token>``
(``gid``: a short hash of the template without its password; ``k``: the slot number, 1..N). The slot's
*exit* (its proxy id, see ``proxies.exit_key``) leaves the token out, so a rotation (a new token, a
new exit IP at the provider) keeps the slot's id, its held leases, its pacing and its sessions; only
the URL in ``P:proxies`` changes, by one script on every host at once (``lua/gateway_rotate.lua``).

A gateway with no ``{session}`` placeholder (a new IP per request) gets N slots of one URL: a
concurrency limit, no per-IP guarantee (``SlotSpec.placeholder`` False; logged at start).

Everything a person sees goes through ``mask`` / ``mask_entry``: a template is a URL with a password.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scrapy_proxy_shard.engine.proxies import SESSION_MARK, SLOT_RE, Proxy, make_proxy, mask
from scrapy_proxy_shard.exceptions import ProxyURLError

#: The placeholder a template holds at most once.
PLACEHOLDER = "{session}"
#: The number of sessions of a gateway entry: ``<template>#sessions=<N>``.
SESSIONS_MARK = "#sessions="
#: Most sessions one entry may declare (each is a pool member; a bigger plan is several entries).
MAX_SESSIONS = 10_000
#: Characters of a session token: lower-case letters and digits fit a user name, a password and a DNS label.
TOKEN_ALPHABET = string.ascii_lowercase + string.digits
TOKEN_LENGTH = 12
_PLACEHOLDER_ANY = re.compile(r"\{[^{}]*\}")


@dataclass(frozen=True)
class GatewaySpec:
    """One gateway entry: its template (with credentials: never shown), N sessions, tags."""

    template: str
    sessions: int
    tags: Mapping[str, str]

    @property
    def placeholder(self) -> bool:
        return PLACEHOLDER in self.template

    @property
    def gid(self) -> str:
        """8 hex digits naming the gateway: a hash of the template without its password (a new password
        keeps the slots; another user name, host or port is another gateway)."""
        scheme, _, rest = self.template.partition("://")
        userinfo, at, address = rest.rpartition("@")
        user = userinfo.partition(":")[0] if at else ""
        return hashlib.blake2b(f"{scheme}://{user}@{address}".encode(), digest_size=4).hexdigest()

    @property
    def masked(self) -> str:
        return mask_entry(f"{self.template}{SESSIONS_MARK}{self.sessions}")

    def slot(self, k: int, token: str | None = None) -> Proxy:
        """Slot ``k`` (1..N) with ``token`` (a new random one when None) as a validated Proxy."""
        if not self.placeholder:
            return make_proxy(f"{self.template}{SESSION_MARK}gw.{self.gid}.{k}", dict(self.tags))
        token = token or new_token()
        url = self.template.replace(PLACEHOLDER, token)
        return make_proxy(f"{url}{SESSION_MARK}gw.{self.gid}.{k}.{token}", dict(self.tags))

    def slots(self) -> list[Proxy]:
        return [self.slot(k) for k in range(1, self.sessions + 1)]

    def __repr__(self) -> str:  # never the password
        return f"GatewaySpec({self.masked!r})"


def new_token() -> str:
    """A random session token (``TOKEN_LENGTH`` letters and digits: about 62 bits)."""
    return "".join(secrets.choice(TOKEN_ALPHABET) for _ in range(TOKEN_LENGTH))


def mask_entry(entry: object) -> str:
    """``mask`` for an entry that may be a gateway template: ``#sessions=N`` and ``{session}`` stay
    visible (they say what the entry is), every credential is hidden."""
    if isinstance(entry, Mapping):
        return f"{{url: {mask_entry(entry.get('url'))}, sessions: {entry.get('sessions')!r}}}"
    if not isinstance(entry, str):
        return mask(entry)
    head, mark, count = entry.rpartition(SESSIONS_MARK)
    if not mark:
        return mask(entry)
    shown = count if count.isascii() and count.isdigit() and len(count) <= 6 else "…"
    return f"{mask(head)}{SESSIONS_MARK}{shown}"


def is_gateway_entry(entry: object) -> bool:
    """Whether a list entry declares a gateway (``#sessions=`` or a ``{session}`` placeholder, or a
    mapping with ``sessions``)."""
    if isinstance(entry, Mapping):
        return True
    return isinstance(entry, str) and (SESSIONS_MARK in entry or PLACEHOLDER in entry)


def parse_gateway(entry: str | Mapping[str, Any], tags: Mapping[str, str] | None = None) -> GatewaySpec:
    """A gateway entry (``<template>#sessions=<N>``, or ``{"url": template, "sessions": N}``) as a spec;
    ProxyURLError naming the entry (masked), the problem and the fix."""
    if isinstance(entry, Mapping):
        unknown = sorted(set(entry) - {"url", "sessions"})
        if unknown or "url" not in entry or "sessions" not in entry:
            extra = f" (unknown: {', '.join(map(str, unknown))})" if unknown else ""
            raise ProxyURLError(f"gateway {mask_entry(entry)}: a gateway mapping has exactly the keys url and "
                                f"sessions, e.g. {{'url': 'http://user-session-{{session}}:pw@gw:7777', "
                                f"'sessions': 50}}{extra}")
        template, count = entry["url"], entry["sessions"]
        if not isinstance(template, str):
            raise ProxyURLError(f"gateway {mask_entry(entry)}: url must be a string")
        if isinstance(count, bool) or not isinstance(count, (int, str)):
            raise ProxyURLError(f"gateway {mask_entry(entry)}: sessions ({type(count).__name__}) must be a whole "
                                f"number from 1 to {MAX_SESSIONS}")
        shown = mask_entry(entry)
        template, count = template.strip(), str(count).strip()
    else:
        if not isinstance(entry, str):
            raise ProxyURLError(f"proxy entry must be a string, got {type(entry).__name__}")
        shown = mask_entry(entry.strip())
        template, mark, count = entry.strip().rpartition(SESSIONS_MARK)
        if not mark:
            raise ProxyURLError(f"gateway {shown!r}: a {PLACEHOLDER} template needs its number of sessions: "
                                f"write {SESSIONS_MARK}N at the end of the entry (e.g. {SESSIONS_MARK}50)")
    if not (count.isascii() and count.isdigit()) or not 1 <= int(count) <= MAX_SESSIONS:
        # the value is shown only when it is a number: text there may be a pasted secret
        said = repr(count) if re.fullmatch(r"-?[0-9]{1,12}", count) else "not a number"
        raise ProxyURLError(f"gateway {shown!r}: the number of sessions ({said}) must be a whole number "
                            f"from 1 to {MAX_SESSIONS} (e.g. {SESSIONS_MARK}50: the sessions your plan allows at once)")
    uses = template.count(PLACEHOLDER)
    if uses > 1:
        raise ProxyURLError(f"gateway {shown!r}: {PLACEHOLDER} appears {uses} times: write it once (in the user "
                            "name, the password or the host), where the provider expects the session token")
    others = [p for p in _PLACEHOLDER_ANY.findall(template) if p != PLACEHOLDER]
    if others:
        raise ProxyURLError(f"gateway {shown!r}: unknown placeholder {others[0][:20]!r}: the only placeholder is "
                            f"{PLACEHOLDER}")
    if SESSION_MARK in template:
        raise ProxyURLError(f"gateway {shown!r}: an entry declares either one session (#session=<token>) or a "
                            f"number of them ({SESSIONS_MARK}N), not both")
    spec = GatewaySpec(template, int(count), dict(tags or {}))
    try:
        spec.slot(1)  # the template with a token in it must be a valid proxy URL
    except ProxyURLError as exc:
        raise ProxyURLError(f"gateway {shown!r}: {_strip_entry(str(exc))}") from None
    return spec


def _strip_entry(message: str) -> str:
    """A parse_proxy message without its leading ``proxy '<masked slot URL>': ``."""
    head, sep, rest = message.partition("': ")
    return rest if sep and head.startswith("proxy '") else message


def expand_entry(entry: str | Mapping[str, Any], tags: Mapping[str, str] | None = None) -> list[Proxy]:
    """One list entry as pool members: a static proxy as itself, a gateway as its N slots (new tokens:
    ``add.lua`` keeps the token of a slot already in the pool, so a restart does not rotate anything)."""
    if is_gateway_entry(entry):
        return parse_gateway(entry, tags).slots()
    return [make_proxy(entry, dict(tags or {}))]


def expand_all(entries: Iterable[str | Proxy | Mapping[str, Any]]) -> list[Proxy]:
    out: list[Proxy] = []
    for entry in entries:
        out.extend([entry] if isinstance(entry, Proxy) else expand_entry(entry))
    return out


def as_entry(entry: Any) -> Any:
    """A settings entry in its string form: a mapping ``{url, sessions}`` becomes ``url#sessions=N``
    (checked first); anything else is returned as is."""
    if isinstance(entry, Mapping):
        spec = parse_gateway(entry)
        return f"{spec.template}{SESSIONS_MARK}{spec.sessions}"
    return entry


# --- slots -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """What a canonical URL says of its gateway slot."""

    gid: str
    k: int
    token: str | None  # None: a gateway without placeholder


def slot_of(url: str) -> Slot | None:
    """The gateway slot a canonical URL (as stored: with its ``#session=`` mark) belongs to, or None."""
    _, mark, session = url.rpartition(SESSION_MARK)
    m = SLOT_RE.fullmatch(session) if mark else None
    if m is None:
        return None
    return Slot(m.group(1), int(m.group(2)), m.group(3))


def masked_slot(proxy: Proxy) -> str:
    """``proxy.masked``, without the token of a gateway slot: what an ``add`` that minted new tokens shows
    (the pool keeps the token a slot already has, see ``expand_entry``)."""
    slot = slot_of(proxy.url)
    if slot is None or slot.token is None:
        return proxy.masked
    return proxy.masked.replace(slot.token, PLACEHOLDER)


def gateway_id(session: str) -> str:
    """The gateway id of a slot's declared session (``Lease.exit_session``), "" for anything else."""
    m = SLOT_RE.fullmatch(session) if session.startswith("gw.") else None
    return m.group(1) if m else ""


# --- options ---------------------------------------------------------------------------------------------

#: Fresh IPs in a row a site may ban (no clean answer between them) before a gateway stops rotating for it,
#: unless the gateway has fewer sessions or PROXY_SHARD_GATEWAY_ROTATIONS says otherwise. A site that
#: accepts fresh IPs answers one of five cleanly; one that blocks them all costs five, not the plan.
DEFAULT_ROTATIONS = 5


@dataclass(frozen=True)
class GatewayOptions:
    """How bans and exits of gateway slots are handled (``PROXY_SHARD_GATEWAY_*``)."""

    #: Rotations one gateway may make for one site within ``window`` with no clean answer through it
    #: there (a clean answer starts the count again) before bans there quarantine slots instead; None:
    #: ``min(sessions, DEFAULT_ROTATIONS)``.
    rotations: int | None = None
    window: float = 600.0
    #: A response header the gateway reports the exit IP in (None: the exit IP is unknown).
    exit_header: str | None = None

    def budget(self, sessions: int) -> int:
        return self.rotations if self.rotations is not None else max(1, min(sessions, DEFAULT_ROTATIONS))
