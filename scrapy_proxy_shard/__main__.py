"""``python -m scrapy_proxy_shard``: the same CLI as the ``scrapy-proxy-shard`` console script."""

from scrapy_proxy_shard.ops.cli import main

if __name__ == "__main__":
    main()
