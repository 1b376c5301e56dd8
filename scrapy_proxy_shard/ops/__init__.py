"""Operator tools: the CLI, its views, the Prometheus exporter, pool snapshots, proxy list files."""
