"""README.md stays the front door, its snippets work, and the documentation site builds strictly.

The site build (``mkdocs build --strict``: a broken link or anchor, a page missing from the nav, a
reference table that does not render) needs the ``docs`` extra: skipped locally when it is not
installed, a failure under ``CI=true`` (``.ci/run`` installs it and also builds the site itself).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scrapy_proxy_shard.engine.gateway import expand_entry
from scrapy_proxy_shard.settings import ShardSettings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
README_LIMIT = 12_000
TEST_COMMAND = "python -m pip install -q -e '.[test]' && python -m pytest"
DEMO_COMMAND = "python -m pip install -q -e '.[demo]' && python -m scrapy_proxy_shard.demo"
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def test_the_readme_stays_short():
    size = len(README.encode("utf-8"))
    assert size <= README_LIMIT, f"README.md is {size} bytes (limit {README_LIMIT}): move detail into docs/"


def test_the_readme_keeps_the_commands_ci_and_users_run():
    assert TEST_COMMAND in README  # .ci/run greps for it, byte for byte
    assert DEMO_COMMAND in README
    assert "pip install scrapy-proxy-shard" in README


def test_the_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    assert [link for link in local if not (ROOT / link).exists()] == []


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_snippets_are_python(path):
    for block in FENCE.findall(path.read_text(encoding="utf-8")):
        ast.parse(block)


def test_the_readme_example_settings_parse_and_name_the_spiders_pools():
    """The example's settings are valid, and every pool its spider uses gets proxies from them."""
    settings_block, spider_block = FENCE.findall(README)[:2]
    namespace: dict = {}
    exec(compile(settings_block, "README settings", "exec"), namespace)
    values = {k: v for k, v in namespace.items() if k.isupper()}
    parsed = ShardSettings.from_settings(values)
    assert parsed.redis_url == values["PROXY_SHARD_REDIS_URL"]
    pools = set(re.findall(r"proxy_pool[\"']?\s*[:=]\s*\"([a-z]+)\"", spider_block))
    assert pools == {"datacenter", "residential"}, pools
    assert pools <= set(values["PROXY_SHARD_PROXIES"]), "the spider names a pool the settings leave empty"
    exec(compile(spider_block, "README spider", "exec"), {})


def test_the_readme_gateway_and_tiers_example_parses():
    """The third example (a gateway entry with 50 sessions, two tiers) is valid settings, proxies too."""
    block = next(b for b in FENCE.findall(README) if "PROXY_SHARD_TIERS" in b)
    namespace: dict = {}
    exec(compile(block, "README gateways and tiers", "exec"), namespace)
    values = {k: v for k, v in namespace.items() if k.isupper()}
    parsed = ShardSettings.from_settings(values)
    assert parsed.tiers == ("datacenter", "residential")
    slots = expand_entry(values["PROXY_SHARD_PROXIES"]["residential"][0])
    assert len(slots) == 50 and len({slot.id for slot in slots}) == 50


@pytest.mark.docs
def test_the_documentation_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocs_click") is None:
        message = "the docs build needs the docs extra: pip install -e '.[docs]'"
        if _on_ci():
            pytest.fail(message + " (required under CI=true)")
        pytest.skip(message)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    settings_page = (tmp_path / "reference" / "settings" / "index.html").read_text(encoding="utf-8")
    assert "PROXY_SHARD_BAN_TTL" in settings_page and "reference:" not in settings_page
    cli_page = (tmp_path / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    # mkdocs-click's table style shows click >= 8.3's UNSET sentinel as every flag's default: plain style
    assert "scrapy-proxy-shard ban" in cli_page and "UNSET" not in cli_page
