"""Reference tables the documentation is generated from: settings, stats, Prometheus metrics, meta keys.

Each table lives next to nothing else and is checked against the code by a test, so the reference
pages of the docs site (``docs/reference/``, rendered by ``markdown.py`` inside ``mkdocs build``) cannot
drift from what the plugin reads, counts and exports:

- ``settings``: one description per key of ``scrapy_proxy_shard.settings.DEFAULTS``
  (tests/test_settings_table.py);
- ``stats``: every Scrapy stat the plugin sets (tests/test_stats_reference.py reads the emitting code);
- ``metrics``: every ``proxy_shard_*`` family the exporter serves, with its type and labels
  (tests/test_stats_reference.py collects them from ``ops.exporter``);
- ``meta``: the ``Request.meta`` keys the plugin reads or sets (tests/test_stats_reference.py).

Nothing in the plugin imports this package: it is documentation, kept in Python so tests can hold it
to the code.
"""
