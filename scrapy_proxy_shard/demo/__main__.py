"""``python -m scrapy_proxy_shard.demo``: see scrapy_proxy_shard/demo/run.py."""

import sys

from scrapy_proxy_shard.demo.run import main

sys.exit(main())
