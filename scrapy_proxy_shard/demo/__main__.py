"""``python -m scrapy_proxy_shard.demo``: see scrapy_proxy_shard/demo/run.py."""

import sys

from .run import main

sys.exit(main())
