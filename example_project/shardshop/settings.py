"""Settings of the example project. Every host runs these same settings against one Redis."""

import os

BOT_NAME = "shardshop"
SPIDER_MODULES = ["shardshop.spiders"]
NEWSPIDER_MODULE = "shardshop.spiders"

# The plugin's middlewares via the add-on (or list them in DOWNLOADER_MIDDLEWARES at 610, 620 and 950).
ADDONS = {"scrapy_proxy_shard.addon.ProxyShardAddon": 0}

PROXY_SHARD_REDIS_URL = os.environ.get("PROXY_SHARD_REDIS_URL", "redis://127.0.0.1:6379/0")
PROXY_SHARD_NAMESPACE = "shardshop"
PROXY_SHARD_POOL = "datacenter"  # the spider names its own pool; this is the fallback
# The local anti-bot site allows one request at a time per IP and site, and 0.2 s between starts
# (counted at the site). MIN_INTERVAL counts between lease starts in Redis; the way from there to the
# site (host, forward proxy, a new connection for a proxy's first request) varies by up to ~150 ms when
# hosts, proxies and site share one busy 2-core machine. A real crawl gives the site's rule and lets the
# plugin learn its path margin (docs/pacing.md); the demo keeps a 0.2 s margin and the arrival guard
# (off by default: it paces each slot from when its last request can have reached the site) anyway,
# because its end-to-end tests assert zero violations on CI machines far busier than a real crawler's.
PROXY_SHARD_SITE_CONCURRENCY = 1
PROXY_SHARD_MIN_INTERVAL = 0.4
PROXY_SHARD_ARRIVAL_GUARD = 0.5
PROXY_SHARD_MAX_WAIT = 60
# Quarantines long enough to outlast the demo crawl, short enough to try again in a real one.
PROXY_SHARD_BAN_TTL = 120
PROXY_SHARD_BAN_MAX_TTL = 1800
PROXY_SHARD_DEAD_TTL = 120
PROXY_SHARD_BAN_RETRIES = 6
PROXY_SHARD_SESSION_TTL = 120

CONCURRENT_REQUESTS = 16
DOWNLOAD_DELAY = 0  # pacing is per (proxy, site), by the lease engine
DOWNLOAD_TIMEOUT = 10
RETRY_TIMES = 3
ROBOTSTXT_OBEY = False
COOKIES_ENABLED = False
TELNETCONSOLE_ENABLED = False
LOG_LEVEL = "INFO"

EXTENSIONS = {"shardshop.extensions.StatsDump": 0}
STATS_DUMP_FILE = os.environ.get("STATS_DUMP_FILE")
