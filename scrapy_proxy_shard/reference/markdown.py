"""Markdown for the reference pages, rendered from the tables of this package.

``render(name)`` returns the Markdown a page's marker line ``<!-- reference: NAME -->`` stands for
(``docs/hooks/reference.py`` substitutes it inside ``mkdocs build``). Defaults in the settings tables
come from ``scrapy_proxy_shard.settings.DEFAULTS`` itself, so a changed default changes the page.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from scrapy_proxy_shard.reference import meta, metrics, settings, stats
from scrapy_proxy_shard.settings import DEFAULTS


def literal(value: Any) -> str:
    """A default as a reader would write it in settings.py: ``"auto"``, ``[403, 429]``, ``60``, ``True``."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def default_cell(doc: settings.SettingDoc) -> str:
    """The default column of one setting: ``DEFAULTS``'s value, or the words for a computed one."""
    if doc.default is not None:
        return doc.default
    unit = f" {doc.unit}" if doc.unit else ""
    return f"`{literal(DEFAULTS[doc.name])}`{unit}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; a ``|`` inside a cell is escaped."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _code(name: str) -> str:
    return f"`{name}`"


def settings_markdown() -> str:
    """Every setting, one table per section, each with its default."""
    parts = []
    for section in settings.SECTIONS:
        rows = [(_code(d.name), default_cell(d), d.meaning) for d in section.settings]
        parts += [f"## {section.title}", section.intro, table(("setting", "default", "meaning"), rows)]
    return "\n\n".join(parts)


def settings_summary_markdown(names: Sequence[str]) -> str:
    """A short table of the named settings (the ones most users set)."""
    docs = {d.name: d for d in settings.all_settings()}
    return table(("setting", "default", "meaning"),
                 [(_code(n), default_cell(docs[n]), docs[n].meaning) for n in names])


def stats_markdown() -> str:
    """Every stat, one table per section."""
    parts = []
    for section in stats.SECTIONS:
        rows = [(", ".join(_code(n) for n in d.names), d.where, d.meaning) for d in section.stats]
        parts += [f"## {section.title}", section.intro, table(("stat", "set where", "meaning"), rows)]
    return "\n\n".join(parts)


def metrics_markdown() -> str:
    """Every metric family, then what each label means."""
    rows = [(_code(m.name), m.kind, ", ".join(m.labels), m.meaning) for m in metrics.METRICS]
    labels = [(_code(name), text) for name, text in metrics.LABELS.items()]
    return "\n\n".join([table(("metric", "type", "labels", "meaning"), rows), "## Labels",
                        table(("label", "values"), labels)])


def meta_markdown() -> str:
    """Every meta key: who sets it and what it means."""
    return table(("key", "set by", "meaning"), [(_code(m.key), m.set_by, m.meaning) for m in meta.META_KEYS])


RENDERERS: dict[str, Callable[[], str]] = {
    "settings": settings_markdown,
    "stats": stats_markdown,
    "metrics": metrics_markdown,
    "meta": meta_markdown,
}


def render(name: str) -> str:
    """The Markdown of one reference table by name; KeyError names the known ones."""
    try:
        return RENDERERS[name]()
    except KeyError:
        raise KeyError(f"no reference table {name!r} (known: {', '.join(sorted(RENDERERS))})") from None
