"""Crawl the catalog of several shops, plus multi-step flows that must keep one IP per session.

Run one copy per host with its own shard: ``scrapy crawl shop -a shard=0 -a shards=3`` (and 1, 2).
The catalog pages go through the ``datacenter`` pool (the spider attribute); the user-like flows
ask for the ``residential`` pool per request and carry ``meta['session_id']`` for a sticky proxy.
"""

import scrapy

from scrapy_proxy_shard import signals as shard_signals
from shardshop.pages import page_item

CATALOG_CSS = ["div.product", "span.price"]
FLOW_CSS = ["a.next-step, div.flow-done"]


class ShopSpider(scrapy.Spider):
    name = "shop"
    proxy_pool = "datacenter"

    def __init__(self, shard=0, shards=1, sites="shop-a.test,shop-b.test,market.test", pages=30,
                 flows=2, flow_steps=4, required_css="", **kwargs):
        super().__init__(**kwargs)
        # -a required_css=SEL[,SEL]: another check for the catalog pages (a wrong one shows how the
        # plugin suspects a check that fails for every proxy: no proxy burnt, the crawl closes)
        self.catalog_css = [s.strip() for s in required_css.split(",") if s.strip()] or CATALOG_CSS
        self.shard, self.shards = int(shard), int(shards)
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard ({shard}) must be in 0..shards-1 (shards={shards})")
        self.sites = [s.strip() for s in sites.split(",") if s.strip()]
        self.pages, self.flows, self.flow_steps = int(pages), int(flows), int(flow_steps)
        self.rebinds = 0

    @classmethod
    def from_crawler(cls, crawler, *args, **kwargs):
        spider = super().from_crawler(crawler, *args, **kwargs)
        crawler.signals.connect(spider.session_rebound, signal=shard_signals.session_rebound)
        return spider

    def session_rebound(self, request, session_id, site, proxy_id):
        self.rebinds += 1
        self.logger.info("session %s moved to proxy %s (its proxy was banned)", session_id, proxy_id)

    async def start(self):
        # Sites interleaved: requests waiting for a lease count against CONCURRENT_REQUESTS, so one
        # site's backlog must not starve the others' idle proxies.
        for site in self.sites:
            for f in range(self.flows):
                yield self.flow_request(site, f"h{self.shard}-{site.split('.')[0]}-{f}", 1)
        for n in range(1, self.pages + 1):
            if n % self.shards != self.shard:
                continue
            for site in self.sites:
                yield scrapy.Request(f"http://{site}/catalog/{n}", callback=self.parse_page,
                                     errback=self.failed, meta={"proxy_shard_required_css": self.catalog_css})

    def flow_request(self, site, flow_id, step):
        return scrapy.Request(
            f"http://{site}/flow/{flow_id}/step/{step}", callback=self.parse_flow, errback=self.failed,
            meta={
                "proxy_pool": "residential",
                "session_id": flow_id,
                "proxy_shard_required_css": FLOW_CSS,
                "proxy_shard_end_session": step == self.flow_steps,
                "flow": (site, flow_id, step),
            },
        )

    def parse_page(self, response):
        yield page_item(response)

    def parse_flow(self, response):
        site, flow_id, step = response.meta["flow"]
        if response.css("div.flow-done"):
            yield {"kind": "flow", "flow_id": flow_id, "site": site, "steps": step,
                   "proxy_id": response.meta.get("proxy_shard_proxy_id")}
        elif step < self.flow_steps:
            yield self.flow_request(site, flow_id, step + 1)

    def failed(self, failure):
        self.logger.error("request failed: %s: %s", failure.request.url, failure.value)
        yield {"kind": "failed", "url": failure.request.url, "error": type(failure.value).__name__}
