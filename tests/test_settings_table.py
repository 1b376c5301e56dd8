"""The settings reference (``scrapy_proxy_shard.reference.settings``), ``DEFAULTS`` and the parser say
the same thing, and so does README.md's short table.

A ``DEFAULTS`` key without a description, a description of a setting ``DEFAULTS`` lacks (or naming
one in its text), a setting named in the package but missing from ``DEFAULTS`` (parsed outside the
table), or in the table but never read by ``ShardSettings.from_settings`` fails; so does a README
default that is a literal and differs. The docs page renders its defaults from ``DEFAULTS`` itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
from scrapy.settings import Settings

from scrapy_proxy_shard.reference import settings as reference
from scrapy_proxy_shard.reference.markdown import default_cell, literal, settings_markdown
from scrapy_proxy_shard.settings import DEFAULTS, ShardSettings

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\|\s*`(PROXY_SHARD_[A-Z0-9_]+)`\s*\|([^|]*)\|")
NAME = re.compile(r"\bPROXY_SHARD_[A-Z0-9_]*[A-Z0-9]\b")
NOT_LITERAL = object()
DOCS = reference.all_settings()


def test_every_default_has_one_description_and_nothing_else_is_described():
    names = [d.name for d in DOCS]
    assert sorted({n for n in names if names.count(n) > 1}) == [], "described twice"
    assert sorted(set(DEFAULTS) - set(names)) == [], (
        "in settings.DEFAULTS but not described in scrapy_proxy_shard/reference/settings.py")
    assert sorted(set(names) - set(DEFAULTS)) == [], "described but not in settings.DEFAULTS"


def test_no_description_names_an_unknown_setting():
    for doc in DOCS:
        named = set(NAME.findall(doc.meaning + (doc.default or "")))
        assert named <= set(DEFAULTS), f"{doc.name}: names {sorted(named - set(DEFAULTS))}"
    for section in reference.SECTIONS:
        assert set(NAME.findall(section.intro)) <= set(DEFAULTS), section.title


def test_a_default_in_words_only_where_defaults_cannot_say_it():
    """The page shows ``DEFAULTS``'s own value; words only stand in for a computed (None) default."""
    for doc in DOCS:
        assert (doc.default is not None) == (DEFAULTS[doc.name] is None), doc.name


def test_the_rendered_page_shows_the_defaults_of_the_table():
    page = settings_markdown()
    assert "| `PROXY_SHARD_BAN_TTL` | `1800` s |" in page
    assert '| `PROXY_SHARD_AUTOTHROTTLE_ENABLED` | `"auto"` |' in page
    assert literal(("http_429", "x")) == '["http_429", "x"]' and literal(60.0) == "60" and literal({}) == "{}"
    for doc in DOCS:
        assert f"| `{doc.name}` | {default_cell(doc)} |" in page


def test_the_lease_ttl_states_the_margin_the_runtime_uses():
    from scrapy_proxy_shard.crawl.runtime import LEASE_MARGIN

    [doc] = [d for d in DOCS if d.name == "PROXY_SHARD_LEASE_TTL"]
    assert re.findall(r"per request at least `download_timeout \+ (\d+)`", doc.meaning) == [f"{LEASE_MARGIN:g}"]


def test_no_setting_is_read_outside_the_table():
    """Every PROXY_SHARD_* name in the package is a DEFAULTS key (so nothing parses its own setting)."""
    stray = {}
    for path in (ROOT / "scrapy_proxy_shard").rglob("*.py"):
        for name in set(NAME.findall(path.read_text(encoding="utf-8"))) - set(DEFAULTS):
            stray.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not stray, f"settings named outside settings.DEFAULTS: {stray}"


def test_every_setting_of_the_table_is_read_by_the_parser():
    class Recording(Settings):
        def __getitem__(self, name: str) -> Any:
            read.add(name)
            return super().__getitem__(name)

    read: set[str] = set()
    ShardSettings.from_settings(Recording())
    assert sorted(set(DEFAULTS) - read) == [], "in DEFAULTS but never read by ShardSettings.from_settings"


# --- README.md's short table: the settings most users set ------------------------------------------

def _literal(cell: str) -> Any:
    """The default a README cell states, or NOT_LITERAL for prose such as ``max(60, ...)``."""
    cell = re.sub(r"\s+s$", "", cell.strip())  # "`60` s": seconds
    if cell == "unset":
        return None
    if not (cell.startswith("`") and cell.endswith("`") and cell.count("`") == 2):
        return NOT_LITERAL
    try:
        return ast.literal_eval(cell.strip("`"))
    except (ValueError, SyntaxError):
        return NOT_LITERAL


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


README_ROWS = [(m.group(1), m.group(2).strip()) for line in (ROOT / "README.md").read_text(encoding="utf-8")
               .splitlines() if (m := ROW.match(line))]


def test_the_readme_has_its_short_settings_table():
    assert 6 <= len(README_ROWS) <= 15, README_ROWS
    assert {"PROXY_SHARD_REDIS_URL", "PROXY_SHARD_PROXIES", "PROXY_SHARD_MIN_INTERVAL"} <= dict(README_ROWS).keys()
    assert _literal("`1800`") == 1800 and _literal("max(60, DOWNLOAD_TIMEOUT + 30)") is NOT_LITERAL


@pytest.mark.parametrize(("name", "cell"), README_ROWS)
def test_readme_settings_exist_and_their_defaults_match(name, cell):
    assert name in DEFAULTS, f"README.md names {name}, which settings.DEFAULTS does not have"
    stated = _literal(cell)
    if stated is not NOT_LITERAL:
        assert _plain(stated) == _plain(DEFAULTS[name]), f"README says {name} defaults to {cell}"
