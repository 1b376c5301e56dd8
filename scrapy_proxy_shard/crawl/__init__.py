"""The Scrapy side: per-crawler runtime, ban policy helpers, body decoding, heartbeats, log stats."""
