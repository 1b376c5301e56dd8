"""The stats, metrics and meta keys references (``scrapy_proxy_shard.reference``) name what the code does.

Stats are read from the package's source: every ``inc_value`` / ``set_value`` call's key (a string or
an f-string whose module constants are resolved; any other ``{...}`` part is a placeholder), the keys
of a counting helper called with literal names (the fallback's ``_inc("entered")``), and the keys
Scrapy's ``get_retry_request`` sets under a ``stats_base_key``. Metrics are the families the exporter
yields. Meta keys are the strings the package reads from or writes to ``request.meta``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fakeredis
import pytest

from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.ops.exporter import PoolCollector
from scrapy_proxy_shard.reference import meta, metrics, stats

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "scrapy_proxy_shard"
PLACEHOLDER = "\x00"  # a part of a stat name the code fills in at run time
#: The keys Scrapy's get_retry_request sets under its stats_base_key (scrapy/downloadermiddlewares/retry.py).
RETRY_SUFFIXES = ("/count", f"/reason_count/{PLACEHOLDER}", "/max_reached")
STAT_CALLS = {"inc_value", "set_value", "max_value", "min_value"}


def _constants(tree: ast.Module, module_of: dict[str, ast.Module]) -> dict[str, str]:
    """Module-level string constants of ``tree``, and those it imports from other package modules."""
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value,
                                                                                               str):
            found.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.ImportFrom) and node.module in module_of:
            theirs = _constants(module_of[node.module], {})
            found.update({a.asname or a.name: theirs[a.name] for a in node.names if a.name in theirs})
    return found


def _strings(node: ast.AST, consts: dict[str, str], params: frozenset[str] = frozenset()) -> list[str]:
    """The strings an expression may be: constants, f-strings (placeholders for unknown parts), both
    branches of ``a if c else b``. A parameter in ``params`` becomes ``{name}`` to expand later."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in consts:
        return [consts[node.id]]
    if isinstance(node, ast.Name) and node.id in params:
        return ["{" + node.id + "}"]
    if isinstance(node, ast.IfExp):
        return _strings(node.body, consts, params) + _strings(node.orelse, consts, params)
    if isinstance(node, ast.FormattedValue):
        return _strings(node.value, consts, params) or [PLACEHOLDER]
    if isinstance(node, ast.JoinedStr):
        out = [""]
        for part in node.values:
            out = [head + tail for head in out for tail in _strings(part, consts, params)]
        return out
    return []


def _module_trees() -> dict[str, ast.Module]:
    trees = {}
    for path in PACKAGE.rglob("*.py"):
        if "demo" in path.relative_to(PACKAGE).parts or "reference" in path.relative_to(PACKAGE).parts:
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        trees[name] = ast.parse(path.read_text(encoding="utf-8"))
    return trees


def emitted_stats() -> set[str]:
    """Every stat key the package sets (``PLACEHOLDER`` for a part filled in at run time)."""
    trees = _module_trees()
    keys: set[str] = set()
    for tree in trees.values():
        consts = _constants(tree, trees)
        helpers: dict[str, list[str]] = {}  # function -> key templates with "{param}" in them
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            params = frozenset(a.arg for a in func.args.args)
            for call in ast.walk(func):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and \
                        call.func.attr in STAT_CALLS and call.args:
                    for key in _strings(call.args[0], consts, params):
                        if "{" in key and isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            helpers.setdefault(func.name, []).append(key)
                        else:
                            keys.add(re.sub(r"\{\w+\}", PLACEHOLDER, key))
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            for kw in call.keywords:
                if kw.arg == "stats_base_key":
                    keys.update(base + s for base in _strings(kw.value, consts) for s in RETRY_SUFFIXES)
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
            for template in helpers.get(name, []) if call.args else []:
                for value in _strings(call.args[0], consts) or [PLACEHOLDER]:
                    keys.add(re.sub(r"\{\w+\}", value, template, count=1))
    return {k for k in keys if k.startswith("proxy_shard/")}


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("".join("[^/]+" if c == PLACEHOLDER else re.escape(c) for c in key))


def _sample(documented: str) -> str:
    return re.sub(r"\{\w+\}", "SAMPLE", documented)


EMITTED = emitted_stats()
DOCUMENTED = [name for doc in stats.all_stats() for name in doc.names]


def test_the_reader_finds_stats_of_every_kind():
    shown = {k.replace(PLACEHOLDER, "*") for k in EMITTED}
    assert {"proxy_shard/leases", "proxy_shard/fallback/entered", "proxy_shard/fallback/leases_overlapped",
            "proxy_shard/fallback/leases_not_adopted", "proxy_shard/ban_retries/count",
            "proxy_shard/ban_retries/reason_count/*", "proxy_shard/release/*", "proxy_shard/local",
            "proxy_shard/skipped", "proxy_shard/autothrottle/interval/*", "proxy_shard/host_id_taken",
            "proxy_shard/leases/abandoned/*"} <= shown, sorted(shown)
    assert len(EMITTED) > 50


def test_every_stat_the_code_sets_is_documented():
    missing = sorted(k.replace(PLACEHOLDER, "{...}") for k in EMITTED
                     if not any(_pattern(k).fullmatch(_sample(d)) for d in DOCUMENTED))
    assert missing == [], "set by the code, missing from scrapy_proxy_shard/reference/stats.py"


def test_every_documented_stat_is_set_by_the_code():
    unknown = sorted(d for d in DOCUMENTED if not any(_pattern(k).fullmatch(_sample(d)) for k in EMITTED))
    assert unknown == [], "documented in scrapy_proxy_shard/reference/stats.py, set nowhere"
    assert len(DOCUMENTED) == len(set(DOCUMENTED)), "a stat documented twice"


# --- metrics ---------------------------------------------------------------------------------------

def exported_families() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name (with ``_total`` for a counter) -> (type, labels) of every family a scrape yields."""
    store = PoolStore(fakeredis.FakeRedis(decode_responses=True), namespace="ref", host_id="ref-host")
    store.add_proxies("default", ["10.9.0.1:3128", "10.9.0.2:3128"])
    lease = store.lease("default", "shop.example", ttl=60)
    store.release(lease, outcome="ban", reason="http_403", latency=0.1, min_interval=1.0)
    out = {}
    for family in PoolCollector(store).collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = (family.type, tuple(family._labelnames))
    return out


def test_every_metric_the_exporter_serves_is_documented_with_its_type_and_labels():
    exported = exported_families()
    documented = {m.name: (m.kind, m.labels) for m in metrics.METRICS}
    assert len(documented) == len(metrics.METRICS), "a metric documented twice"
    assert sorted(set(exported) - set(documented)) == [], "served, missing from reference/metrics.py"
    assert sorted(set(documented) - set(exported)) == [], "documented in reference/metrics.py, never served"
    assert {n: v for n, v in exported.items() if documented[n] != v} == {}, "type or labels differ"
    used = {label for _, labels in exported.values() for label in labels}
    assert used == set(metrics.LABELS), "every label, and only those, explained"


# --- meta keys -------------------------------------------------------------------------------------

def _meta_strings() -> set[str]:
    """String keys the package reads from or writes to a ``meta`` mapping."""
    found: set[str] = set()
    for tree in _module_trees().values():
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Subscript):
                target, key = node.value, node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("get", "pop", "setdefault") and node.args:
                target, key = node.func.value, node.args[0]
            if target is None or not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                continue
            if (isinstance(target, ast.Name) and target.id == "meta") or \
                    (isinstance(target, ast.Attribute) and target.attr == "meta"):
                found.add(key.value)
    return found


META_USED = _meta_strings()


@pytest.mark.parametrize("doc", meta.META_KEYS, ids=lambda d: d.key)
def test_every_documented_meta_key_is_used_by_the_code(doc):
    assert doc.key in META_USED


def test_every_plugin_meta_key_is_documented():
    ours = {k for k in META_USED if k.startswith("proxy_shard") or k in ("session_id", "proxy_pool")}
    assert {"proxy_shard_end_session", "session_id", "proxy_pool"} <= ours
    assert sorted(ours - {m.key for m in meta.META_KEYS}) == [], "missing from reference/meta.py"


def test_the_readme_meta_table_names_the_keys_you_set():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Meta keys", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE))
    assert named == {m.key for m in meta.META_KEYS if m.set_by == meta.YOU}
