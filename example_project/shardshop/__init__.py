"""Example Scrapy project: a shop crawler that shares one proxy pool with its peers on other hosts."""
