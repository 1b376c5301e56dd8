"""Proxy list files: moved to ``scrapy_proxy_shard.engine.proxyfile`` (issue 21), where the crawl's
``PROXY_SHARD_PROXIES_PATH`` setting and the CLI's ``load`` both use it; this name stays for imports."""

from scrapy_proxy_shard.engine.proxyfile import (  # noqa: F401
    COLUMNS,
    LineError,
    ProxyList,
    check_tags,
    decode_proxy_list,
    parse_proxy_list,
    read_proxy_file,
)
