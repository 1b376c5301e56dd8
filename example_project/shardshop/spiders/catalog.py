"""Crawl a static catalog by its links: each index, then the item pages it links to (HTTP or HTTPS).

Run one copy per host with its own shard: ``scrapy crawl catalog -a start_urls=URL,URL -a shard=0
-a shards=3``. Every host reads each index and follows the items whose number falls in its shard, so
the hosts split the items between them. Used against the stock nginx stack
(``scrapy_proxy_shard.demo.nginx_stack``, tests/test_nginx_stack.py, benchmarks/bench_nginx.py).
"""

import re

import scrapy

from shardshop.pages import page_item

ITEM_CSS = ["div.product", "span.price"]
ITEM_NUMBER = re.compile(r"/item/(\d+)\.html$")


class CatalogSpider(scrapy.Spider):
    name = "catalog"
    proxy_pool = "datacenter"

    def __init__(self, start_urls="", shard=0, shards=1, **kwargs):
        super().__init__(**kwargs)
        self.shard, self.shards = int(shard), int(shards)
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard ({shard}) must be in 0..shards-1 (shards={shards})")
        self.start_urls = [u.strip() for u in start_urls.split(",") if u.strip()]
        if not self.start_urls:
            raise ValueError("give the catalog indexes: -a start_urls=URL[,URL...]")

    async def start(self):
        for url in self.start_urls:
            yield scrapy.Request(url, callback=self.parse_index, errback=self.failed)

    def parse_index(self, response):
        for href in response.css("a.item::attr(href)").getall():
            url = response.urljoin(href)
            found = ITEM_NUMBER.search(url)
            if found and int(found.group(1)) % self.shards == self.shard:
                yield scrapy.Request(url, callback=self.parse_item, errback=self.failed,
                                     meta={"proxy_shard_required_css": ITEM_CSS})

    def parse_item(self, response):
        yield page_item(response)

    def failed(self, failure):
        self.logger.error("request failed: %s: %s", failure.request.url, failure.value)
        yield {"kind": "failed", "url": failure.request.url, "error": type(failure.value).__name__}
