"""scrapy-playwright requests go out through their leased proxy: one browser context per proxy.

scrapy-playwright ignores ``meta['proxy']``: its browser downloads a ``meta['playwright']`` request
in the context named ``meta['playwright_context']``, created on first use from
``meta['playwright_context_kwargs']``. So a leased browser request is bound to the context
``proxy-shard:<proxy id>:<url hash>``, created with Playwright's ``proxy`` option (server
``scheme://host:port``; the credentials in its ``username``/``password`` fields, never in the URL).
The proxy id hashes the exit (host:port) only; the URL hash (blake2b, 8 hex digits, keyed per
process: never the credentials themselves) covers the full URL, credentials included. Since
scrapy-playwright reuses a context by name and ignores new kwargs, a context can only ever have
been created for that exit with those credentials: after a password rotation (CLI add/load) the
requests go to a new context, not one still authenticating with the old password.

What is refused (the request fails, never goes out through another context): a ``playwright_context``
the user set, a ``proxy`` the user put in ``playwright_context_kwargs``, and a ``playwright_page`` that
does not belong to the bound context. Which of the proxy's contexts a request gets, and when one is
closed (quarantine, removal, sessions, the PLAYWRIGHT_MAX_CONTEXTS bound, pages the spider keeps):
crawl/contexts.py; names after a proxy's first context are ``<first>:<n>`` and ``<first>:s<hash>``.
Not built here: scrapy-playwright's threaded loop (Windows).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from scrapy import Request
from scrapy.utils.httpobj import urlparse_cached

from scrapy_proxy_shard.crawl.handlers import context_name

#: meta key: the context name the plugin set (a copy of the request may be bound again).
OWN_CONTEXT = "_proxy_shard_context"
PROXY_AUTHORIZATION = b"Proxy-Authorization"


def bind_problem(meta: dict) -> str | None:
    """Why a browser request cannot be bound to a leased proxy's context (checked before leasing)."""
    own = meta.get(OWN_CONTEXT)
    context = meta.get("playwright_context")
    if context is not None and context != own:
        return (f"meta['playwright_context'] is {context!r}: a browser context of your own may not use the "
                f"proxy leased for the request; remove it (the plugin binds the request to its proxy's context)")
    kwargs = meta.get("playwright_context_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return f"meta['playwright_context_kwargs'] must be a dict, not {type(kwargs).__name__}"
    if kwargs and "proxy" in kwargs and own is None:
        return ("meta['playwright_context_kwargs'] sets a 'proxy' of its own; remove it (the plugin sets the "
                "leased proxy)")
    return None


def playwright_proxy(proxy_url: str) -> dict[str, str]:
    """Playwright's ``proxy`` option for a proxy URL: credentials in their own fields."""
    parts = urlsplit(proxy_url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    out = {"server": f"{parts.scheme}://{host}:{port}"}
    if parts.username is not None:
        out["username"] = unquote(parts.username)
        out["password"] = unquote(parts.password or "")
    return out


def bind(meta: dict, proxy_id: str, proxy_url: str, name: str | None = None) -> None:
    """Bind a browser request to the context of its leased proxy (a new kwargs dict: meta is shared
    shallowly with copies of the request). ``name``: one of the proxy's contexts (``BrowserContexts``
    picks it: a session's, or a later one after a close); its first one by default."""
    base = context_name(proxy_id, proxy_url)
    if name is None:
        name = base
    elif not belongs(name, base):
        raise ValueError(f"context {name!r} is not one of proxy {proxy_id}'s")
    kwargs = dict(meta.get("playwright_context_kwargs") or {})
    kwargs["proxy"] = playwright_proxy(proxy_url)
    meta["playwright_context"] = meta[OWN_CONTEXT] = name
    meta["playwright_context_kwargs"] = kwargs


def unbind(meta: dict) -> None:
    """Undo ``bind`` in place (a request kept for another run leases and binds again): the context
    name, its marker and the proxy (credentials included) in ``playwright_context_kwargs``; the
    user's other context kwargs stay."""
    own = meta.pop(OWN_CONTEXT, None)
    if own is None:
        return
    if meta.get("playwright_context") == own:
        del meta["playwright_context"]
    kwargs = meta.get("playwright_context_kwargs")
    if isinstance(kwargs, dict) and "proxy" in kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k != "proxy"}  # a new dict: meta is shared shallowly
        if kwargs:
            meta["playwright_context_kwargs"] = kwargs
        else:
            del meta["playwright_context_kwargs"]


def binding_problem(request: Request, proxy_id: str, proxy_url: str, crawler: Any) -> str | None:
    """What the guard checks on a leased browser request just before it is downloaded."""
    meta = request.meta
    name = context_name(proxy_id, proxy_url)
    if not belongs(meta.get("playwright_context"), name):
        return (f"meta['playwright_context'] is {meta.get('playwright_context')!r}, not the context of the "
                f"leased proxy {proxy_id} ({name!r})")
    kwargs = meta.get("playwright_context_kwargs")
    proxy = kwargs.get("proxy") if isinstance(kwargs, dict) else None
    if not isinstance(proxy, dict) or proxy != playwright_proxy(proxy_url):
        return f"meta['playwright_context_kwargs'] does not carry the leased proxy {proxy_id}"
    page = meta.get("playwright_page")
    name = meta["playwright_context"]
    if page is not None and not _closed(page) and not _page_in_context(page, request, crawler, name):
        return (f"meta['playwright_page'] is a page of another browser context than the leased proxy's "
                f"({name!r}): it would go out through another IP")
    return None


def belongs(name: object, base: str) -> bool:
    """``name`` is one of the contexts of the proxy whose first context is ``base`` (the proxy id and
    the hash of its URL; the names under the reserved prefix are the plugin's alone)."""
    return isinstance(name, str) and (name == base or name.startswith(base + ":"))


def drop_proxy_authorization(request: Request) -> None:
    """The browser authenticates to the proxy from the context; a ``Proxy-Authorization`` header
    (HttpProxyMiddleware's) would be sent by it to the site itself, credentials included."""
    request.headers.pop(PROXY_AUTHORIZATION, None)


def _closed(page: Any) -> bool:
    try:
        return bool(page.is_closed())
    except Exception:  # not a Playwright page: scrapy-playwright makes a new one
        return True


def _page_in_context(page: Any, request: Request, crawler: Any, name: str) -> bool:
    """The page belongs to the context scrapy-playwright holds under ``name`` (unknown: False)."""
    try:
        handlers = crawler.engine.downloader.handlers._handlers  # Scrapy's DownloadHandlers
        wrapper = handlers[urlparse_cached(request).scheme].context_wrappers.get(name)
        return wrapper is not None and page.context is wrapper.context
    except Exception:  # cannot tell: refuse
        return False
