"""The shared pool itself: Lua scripts, key schema, the store that runs them. No Scrapy import."""
