"""Write the crawl's final stats as JSON (the demo's summary reads them)."""

import json

from scrapy import signals
from scrapy.exceptions import NotConfigured


class StatsDump:
    def __init__(self, crawler, path):
        self.crawler = crawler
        self.path = path

    @classmethod
    def from_crawler(cls, crawler):
        path = crawler.settings.get("STATS_DUMP_FILE")
        if not path:
            raise NotConfigured("STATS_DUMP_FILE is not set")
        ext = cls(crawler, path)
        crawler.signals.connect(ext.spider_closed, signal=signals.spider_closed)
        return ext

    def spider_closed(self, spider, reason):
        raw = self.crawler.stats.get_stats()
        stats = {k: v if isinstance(v, (int, float, str)) else str(v) for k, v in raw.items()}
        stats["finish_reason"] = reason
        with open(self.path, "w", encoding="utf-8") as fh:
            json.dump(stats, fh, indent=1, sort_keys=True)
