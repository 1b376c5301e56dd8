"""scrapy-impersonate requests go out through their leased proxy, and only through it (issue 22).

scrapy-impersonate's handler downloads a ``meta['impersonate']`` request with curl_cffi: the proxy is
``meta['proxy']``, the credentials HttpProxyMiddleware's ``Proxy-Authorization`` (sent to the proxy
alone, as ``CURLOPT_PROXYHEADER``). Three ways around it, found end to end on the local site (each
sent every page from the host's own IP, exit 0):

- ``no_proxy`` / ``NO_PROXY`` in the environment: curl_cffi leaves libcurl to read it (its
  ``trust_env``, on in scrapy-impersonate's sessions), and libcurl then bypasses even a proxy passed
  explicitly. The guard sets curl's ``NOPROXY`` option to ``""`` on every leased impersonate request
  (applied last by scrapy-impersonate, in ``meta['impersonate_curl_options']``): no host is exempt.
- ``meta['impersonate_args']`` with ``proxy`` / ``proxies`` / ``proxy_auth``: passed to curl_cffi after
  ``meta['proxy']`` and winning over it (``{'proxy': None}`` sends direct).
- ``meta['impersonate_curl_options']`` setting a proxy option (``PROXY``, ``NOPROXY`` other than ``""``,
  ``PRE_PROXY``...) or a Unix socket instead of the network: applied after everything else.

The last two are refused (the request fails before it is leased; the guard checks again just before
the download): the plugin chooses the proxy. A request without ``meta['impersonate']`` is downloaded
by Scrapy's HTTP/1.1 handler, which scrapy-impersonate's extends, through ``meta['proxy']``.
"""

from __future__ import annotations

from typing import Any

#: ``impersonate_args`` keys that would replace the leased proxy or its credentials.
REFUSED_ARGS = frozenset({"proxy", "proxies", "proxy_auth"})
#: libcurl options (``CurlOpt`` names) that would send a request elsewhere than the leased proxy.
REFUSED_CURL_OPTIONS = frozenset({
    "PROXY", "PRE_PROXY", "NOPROXY", "PROXYPORT", "PROXYTYPE", "PROXYUSERPWD", "PROXYUSERNAME",
    "PROXYPASSWORD", "UNIX_SOCKET_PATH", "ABSTRACT_UNIX_SOCKET",
})
ARGS = "impersonate_args"
CURL_OPTIONS = "impersonate_curl_options"


def applies(meta: dict) -> bool:
    """The request will be downloaded by curl_cffi (else by Scrapy's HTTP/1.1 handler)."""
    return bool(meta.get("impersonate"))


def _option_name(option: Any) -> str:
    """A curl option as scrapy-impersonate accepts it (a ``CurlOpt``, its int value, or its name)."""
    if isinstance(option, str):
        return option.upper()
    name = getattr(option, "name", None)
    if isinstance(name, str):
        return name
    try:
        from curl_cffi import CurlOpt

        return CurlOpt(option).name
    except Exception:  # not an option curl_cffi knows (scrapy-impersonate will fail it), or no curl_cffi
        return repr(option)


def request_problem(meta: dict) -> str | None:
    """Why an impersonate request cannot be sent through its leased proxy (None: it can)."""
    if not applies(meta):
        return None
    args = meta.get(ARGS)
    if args is not None and not isinstance(args, dict):
        return f"meta[{ARGS!r}] must be a dict, not {type(args).__name__}"
    own = sorted(REFUSED_ARGS & set(args or {}))
    if own:
        return (f"meta[{ARGS!r}] sets {', '.join(own)}: curl_cffi would use it instead of the leased proxy; "
                f"remove it (the plugin sets meta['proxy'])")
    options = meta.get(CURL_OPTIONS)
    if options is not None and not isinstance(options, dict):
        return f"meta[{CURL_OPTIONS!r}] must be a dict, not {type(options).__name__}"
    # NOPROXY "" exempts no host: the plugin's own (pin_proxy), harmless from anyone.
    names = sorted({name for name, value in ((_option_name(o), v) for o, v in (options or {}).items())
                    if name in REFUSED_CURL_OPTIONS and not (name == "NOPROXY" and value in ("", b""))})
    if names:
        return (f"meta[{CURL_OPTIONS!r}] sets {', '.join(names)}: the request could leave elsewhere than "
                f"through the leased proxy; remove it")
    return None


def pin_proxy(meta: dict) -> None:
    """No host bypasses the proxy, whatever ``no_proxy`` says in the environment (a new dict: meta is
    shared shallowly with copies of the request)."""
    if applies(meta):
        meta["impersonate_curl_options"] = {**(meta.get("impersonate_curl_options") or {}), "NOPROXY": ""}
