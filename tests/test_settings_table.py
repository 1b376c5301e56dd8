"""The README's settings tables, ``DEFAULTS`` and the parser say the same thing.

A setting documented but not in ``DEFAULTS``, in ``DEFAULTS`` but not documented, named in the package
but missing from ``DEFAULTS`` (parsed outside the table), or in the table but never read by
``ShardSettings.from_settings`` fails; so does a README default that is a literal and differs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
from scrapy.settings import Settings

from scrapy_proxy_shard.settings import DEFAULTS, ShardSettings

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\|\s*(`PROXY_SHARD_[A-Z0-9_]+`(?:\s*/\s*`PROXY_SHARD_[A-Z0-9_]+`)*)\s*\|([^|]*)\|")
NAME = re.compile(r"\bPROXY_SHARD_[A-Z0-9_]*[A-Z0-9]\b")
NOT_LITERAL = object()


def _readme_rows(text: str) -> list[tuple[str, str]]:
    """(setting, default cell) for every settings-table row, a row naming several settings split."""
    rows = []
    for line in text.splitlines():
        match = ROW.match(line)
        if not match:
            continue
        names = [n.strip().strip("`") for n in match.group(1).split("/")]
        cell = match.group(2).strip()
        unit = " s" if cell.endswith(" s") else ""  # "`10` / `60` s": the unit applies to each
        parts = [p.strip() + unit for p in cell.removesuffix(unit).split(" / ")]
        if len(parts) == 1:
            parts *= len(names)
        assert len(parts) == len(names), f"README row {names}: {len(names)} settings but defaults {cell!r}"
        rows += list(zip(names, parts, strict=True))
    return rows


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


ROWS = _readme_rows((ROOT / "README.md").read_text(encoding="utf-8"))
DOCUMENTED = {name for name, _ in ROWS}


def test_the_reader_finds_the_tables_including_rows_with_several_settings():
    assert "PROXY_SHARD_BAN_MAX_TTL" in DOCUMENTED and "PROXY_SHARD_REDIS_SENTINEL_MASTER" in DOCUMENTED
    assert ("PROXY_SHARD_LOGSTATS_INTERVAL", "`60` s") in ROWS and ("PROXY_SHARD_BAN_TTL", "`1800` s") in ROWS
    assert _literal("`1800`") == 1800 and _literal("max(60, DOWNLOAD_TIMEOUT + 30)") is NOT_LITERAL


def test_every_documented_setting_is_parsed_and_every_parsed_one_documented():
    assert sorted(DOCUMENTED - set(DEFAULTS)) == [], "documented in README.md but not in settings.DEFAULTS"
    assert sorted(set(DEFAULTS) - DOCUMENTED) == [], "in settings.DEFAULTS but not documented in README.md"


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


@pytest.mark.parametrize(("name", "cell"), [row for row in ROWS if _literal(row[1]) is not NOT_LITERAL])
def test_readme_defaults_match_the_table(name, cell):
    assert _plain(_literal(cell)) == _plain(DEFAULTS[name]), f"README says {name} defaults to {cell}"


def test_a_setting_documented_twice_states_one_default():
    seen: dict[str, str] = {}
    for name, cell in ROWS:
        assert seen.setdefault(name, cell) == cell, f"{name}: README states {seen[name]!r} and {cell!r}"
