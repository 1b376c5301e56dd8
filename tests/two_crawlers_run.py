"""Run two ``shop`` crawlers of the example project in ONE process (``AsyncCrawlerProcess``).

Used by tests/test_process_engine.py as a subprocess, from the example project's directory:

    python two_crawlers_run.py OUT_JSON shards=2 pages=20 sites=a.test,b.test [-s NAME=VALUE ...]

Crawler ``i`` crawls shard ``i`` of ``shards``; both get the same ``-s`` settings. OUT_JSON receives
each crawler's stats and the process's exit status (Scrapy's ``bootstrap_failed``).
"""

from __future__ import annotations

import json
import sys

from scrapy.crawler import AsyncCrawlerProcess
from scrapy.utils.project import get_project_settings


def main(argv: list[str]) -> int:
    out, args = argv[0], argv[1:]
    spider_args: dict[str, str] = {}
    overrides: dict[str, str] = {}
    while args:
        arg = args.pop(0)
        if arg == "-s":
            name, _, value = args.pop(0).partition("=")
            overrides[name] = value
        else:
            name, _, value = arg.partition("=")
            spider_args[name] = value
    settings = get_project_settings()
    settings.setdict(overrides, priority="cmdline")
    process = AsyncCrawlerProcess(settings)
    shards = int(spider_args.get("shards", "2"))
    crawlers = []
    for shard in range(shards):
        crawler = process.create_crawler("shop")
        crawlers.append(crawler)
        process.crawl(crawler, shard=shard, **{k: v for k, v in spider_args.items() if k != "shard"})
    process.start()
    stats = [{k: v for k, v in (c.stats.get_stats() or {}).items() if isinstance(v, (int, float, str))}
             for c in crawlers]
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"failed": bool(process.bootstrap_failed), "stats": stats}, fh, default=str)
    return 1 if process.bootstrap_failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
