"""``scrapy-proxy-shard``: see and change the shared pool while crawls run (also ``python -m scrapy_proxy_shard``).

Every change goes through the same Lua scripts the crawls use, so it is atomic and visible to every
host at once: no restart, no reload. Views read Redis at the moment they run (``snapshot.py``).

Exit codes: 0 done; 1 operational error (Redis unreachable — except for ``metrics``, which serves
``proxy_shard_up 0`` instead — unknown pool or proxy), printed as one
``Error: ...`` line on stderr, never a traceback; 2 usage or validation error (bad option, bad
proxy line; click's own usage errors are 2 too). Output never holds a credential: proxies show as
id and masked URL, the Redis URL is masked in errors.

Inside a Scrapy project (a ``scrapy.cfg`` in the working directory or above it, or
``SCRAPY_SETTINGS_MODULE``, as for ``scrapy`` commands) the Redis URL, namespace, default pool and
Cluster/Sentinel settings come from the project's settings unless an option or a ``PROXY_SHARD_*``
environment variable gives them; one line on stderr says where each came from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from scrapy_proxy_shard._version import __version__
from scrapy_proxy_shard.engine.exits import merge_exits
from scrapy_proxy_shard.engine.gateway import expand_entry, is_gateway_entry, masked_slot, parse_gateway
from scrapy_proxy_shard.engine.proxies import PROXY_TYPES, Proxy, mask, parse_proxy, split_credentials
from scrapy_proxy_shard.engine.schema import check_name
from scrapy_proxy_shard.engine.sites import SITE_KEY_RE, check_site
from scrapy_proxy_shard.engine.store import PoolStore
from scrapy_proxy_shard.engine.store_admin import MIGRATE_SAFE_WARMUP
from scrapy_proxy_shard.exceptions import (
    PoolBackendError,
    ProxyShardError,
    ProxyURLError,
    SettingError,
    UnknownPoolError,
)
from scrapy_proxy_shard.modes.connection import sync_client
from scrapy_proxy_shard.ops import views
from scrapy_proxy_shard.ops.proxyfile import check_tags, decode_proxy_list, parse_proxy_list
from scrapy_proxy_shard.ops.snapshot import read_pool
from scrapy_proxy_shard.settings import DEFAULTS, MAX_LEASE_TTL, BanOptions, ShardSettings

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: Longest quarantine the CLI sets (ten years): the scripts compute ``now_ms + ttl_ms``, which must stay
#: a plain integer (1e300 seconds became a ban "until" -2**63, counted and shown as started).
MAX_BAN_TTL = 10 * 365 * 86400.0
DEFAULT_POOL = "default"
CLI_HOST_ID = "cli"


class OperationalError(click.ClickException):
    """Exit 1: the command was fine but could not be carried out (Redis down, unknown proxy...)."""

    exit_code = 1


class InputError(click.ClickException):
    """Exit 2: what the user gave is invalid (bad proxy URL, bad line in a file, bad name)."""

    exit_code = 2


@dataclass
class Ctx:
    """Global options, and the store built from them on first use."""

    redis_url: str
    namespace: str
    pool: str | None
    cluster: bool = False
    sentinels: str | list[str] | None = None
    sentinel_master: str | None = None
    #: The pool a change applies to without --pool: the Scrapy project's PROXY_SHARD_POOL, else "default".
    default_pool: str = DEFAULT_POOL
    _store: PoolStore | None = None

    @property
    def store(self) -> PoolStore:
        """A blocking store on the same kind of Redis the crawls use (plain, Cluster or Sentinel)."""
        if self._store is None:
            settings = ShardSettings.from_settings({
                "PROXY_SHARD_REDIS_URL": self.redis_url, "PROXY_SHARD_NAMESPACE": self.namespace,
                "PROXY_SHARD_HOST_ID": CLI_HOST_ID, "PROXY_SHARD_REDIS_CLUSTER": self.cluster,
                "PROXY_SHARD_REDIS_SENTINELS": self.sentinels,
                "PROXY_SHARD_REDIS_SENTINEL_MASTER": self.sentinel_master,
            })
            self._store = PoolStore(sync_client(settings), namespace=self.namespace, host_id=CLI_HOST_ID,
                                    bans=BanOptions(jitter=0.0),
                                    url_for_errors=None if self.sentinels else self.redis_url)
        return self._store

    @property
    def target_pool(self) -> str:
        """The pool a change applies to: ``--pool``, else the project's ``PROXY_SHARD_POOL``, else ``default``."""
        return self.pool or self.default_pool

    def close(self) -> None:
        if self._store is not None:
            self._store.client.close()
            self._store = None

    def view_pools(self) -> list[str]:
        """The pools a view shows: ``--pool`` (which must exist), else every pool of the namespace."""
        known = self.store.pools()
        if self.pool is not None:
            if self.pool not in known and self.store.pool_size(self.pool) == 0:
                raise OperationalError(f"pool {self.pool!r} does not exist in namespace {self.namespace!r} "
                                       f"(pools: {', '.join(known) or 'none'})")
            return [self.pool]
        if not known:
            raise OperationalError(f"namespace {self.namespace!r} has no pools yet "
                                   "(scrapy-proxy-shard load FILE, or check --namespace / --redis-url)")
        return known


class _Group(click.Group):
    """Turns the package's errors into one line and the right exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ProxyURLError, SettingError) as exc:
            raise InputError(str(exc)) from None
        except (PoolBackendError, UnknownPoolError) as exc:
            raise OperationalError(str(exc)) from None
        except ProxyShardError as exc:
            raise OperationalError(str(exc)) from None
        except BrokenPipeError:  # `... | head`: stop quietly (and let the final flush go nowhere)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)


def _check_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise click.BadParameter(f"{mask(value)!r} must start with redis://, rediss:// or unix://")
    return value


def _check_name(kind: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        try:
            return check_name(kind, value)
        except SettingError as exc:
            raise click.BadParameter(str(exc)) from None
    return check


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--redis-url", envvar=["PROXY_SHARD_REDIS_URL", "REDIS_URL"], default=DEFAULT_REDIS_URL,
              show_default=True, show_envvar=True, callback=_check_url, help="Redis every host points at.")
@click.option("--namespace", envvar="PROXY_SHARD_NAMESPACE", default="proxy_shard", show_default=True,
              show_envvar=True, callback=_check_name("namespace"), help="Key prefix (PROXY_SHARD_NAMESPACE).")
@click.option("--pool", envvar="PROXY_SHARD_POOL", default=None, show_envvar=True, callback=_check_name("pool"),
              help="Pool to act on. Changes default to 'default' (in a Scrapy project: its PROXY_SHARD_POOL); "
                   "views default to every pool.")
@click.option("--cluster", is_flag=True, envvar="PROXY_SHARD_REDIS_CLUSTER", show_envvar=True,
              help="The URL names a Redis Cluster node.")
@click.option("--sentinels", envvar="PROXY_SHARD_REDIS_SENTINELS", show_envvar=True, metavar="HOST:PORT,...",
              help="Find the master through these Sentinels (with --sentinel-master).")
@click.option("--sentinel-master", envvar="PROXY_SHARD_REDIS_SENTINEL_MASTER", show_envvar=True,
              help="Name of the master the Sentinels watch.")
@click.version_option(__version__, "-V", "--version", prog_name="scrapy-proxy-shard")
@click.pass_context
def cli(ctx: click.Context, redis_url: str, namespace: str, pool: str | None, cluster: bool,
        sentinels: str | None, sentinel_master: str | None) -> None:
    """See and change the proxy pool shared by Scrapy processes on many hosts, while they run.

    Inside a Scrapy project, its settings give the Redis URL, namespace and default pool unless an
    option or a PROXY_SHARD_* environment variable does.
    """
    ctx.obj = Ctx(redis_url, namespace, pool, cluster, sentinels, sentinel_master)
    _apply_project_settings(ctx, ctx.obj)
    ctx.call_on_close(ctx.obj.close)


# --- a Scrapy project's settings -------------------------------------------------------------------

#: Ctx field -> (option, the project setting(s) read, first wins; environment variables that beat the project).
_FROM_PROJECT: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "redis_url": ("--redis-url", ("PROXY_SHARD_REDIS_URL", "REDIS_URL"), ("PROXY_SHARD_REDIS_URL",)),
    "namespace": ("--namespace", ("PROXY_SHARD_NAMESPACE",), ("PROXY_SHARD_NAMESPACE",)),
    "default_pool": ("--pool", ("PROXY_SHARD_POOL",), ("PROXY_SHARD_POOL",)),
    "cluster": ("--cluster", ("PROXY_SHARD_REDIS_CLUSTER",), ("PROXY_SHARD_REDIS_CLUSTER",)),
    "sentinels": ("--sentinels", ("PROXY_SHARD_REDIS_SENTINELS",), ("PROXY_SHARD_REDIS_SENTINELS",)),
    "sentinel_master": ("--sentinel-master", ("PROXY_SHARD_REDIS_SENTINEL_MASTER",),
                        ("PROXY_SHARD_REDIS_SENTINEL_MASTER",)),
}


def _project_settings() -> tuple[str, Any] | None:
    """``(settings module, Settings)`` of the Scrapy project around the working directory, found as
    ``scrapy`` commands find it (``scrapy.cfg`` upward, ``SCRAPY_SETTINGS_MODULE``); None outside one."""
    from scrapy.utils.project import ENVVAR, get_project_settings, inside_project

    if not inside_project():
        return None
    try:
        settings = get_project_settings()
    except Exception as exc:  # the project's own settings module failed to import: say so, go on without it
        # Where, not what: the message of an error in a settings file may quote a line holding a password.
        click.echo(f"scrapy-proxy-shard: warning: cannot read the Scrapy project's settings "
                   f"({os.environ.get(ENVVAR) or 'scrapy.cfg'}: {type(exc).__name__}{_where(exc)}); using options, "
                   "environment and defaults", err=True)
        return None
    return os.environ.get(ENVVAR) or "scrapy.cfg", settings


def _where(exc: BaseException) -> str:
    """`` at FILE:LINE`` of an exception (the innermost frame, or a SyntaxError's own place), or ""."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" at {os.path.basename(exc.filename)}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    return f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def _apply_project_settings(ctx: click.Context, obj: Ctx) -> None:
    """Inside a Scrapy project: fill what no option and no PROXY_SHARD_* variable gave from the project's
    settings (``REDIS_URL`` too, as the crawl falls back to it), and say in one stderr line where each
    value came from. Outside one: nothing (and nothing printed)."""
    found = _project_settings()
    if found is None:
        return
    module, settings = found
    sources = {}
    for name, (option, setting_names, env_names) in _FROM_PROJECT.items():
        param = "pool" if name == "default_pool" else name
        source = ctx.get_parameter_source(param)
        if source is ParameterSource.COMMANDLINE:
            sources[name] = option
            continue
        env = next((e for e in env_names if os.environ.get(e)), None)
        if source is ParameterSource.ENVIRONMENT and env:
            sources[name] = env
            continue
        setting = next((s for s in setting_names if settings.get(s) not in (None, "")), None)
        if setting is None:
            sources[name] = "environment REDIS_URL" if source is ParameterSource.ENVIRONMENT else "default"
            continue
        setattr(obj, name, _project_value(name, setting, settings))
        sources[name] = "project" if setting == setting_names[0] else f"project {setting}"
    shown = [f"Redis {mask(obj.redis_url)} ({sources['redis_url']})",
             f"namespace {obj.namespace!r} ({sources['namespace']})",
             f"pool for changes {obj.target_pool!r} ({sources['default_pool']})"]
    if obj.cluster:
        shown.append(f"Redis Cluster ({sources['cluster']})")
    if obj.sentinels:
        shown.append(f"Sentinel master {obj.sentinel_master!r} ({sources['sentinel_master']})")
    click.echo(f"scrapy-proxy-shard: Scrapy project {module}: {', '.join(shown)}", err=True)


def _project_value(name: str, setting: str, settings: Any) -> Any:
    """A project setting checked as its option is; InputError (exit 2) naming the setting otherwise."""
    value = settings.get(setting)
    try:
        if name == "redis_url":
            if not isinstance(value, str) or not value.startswith(("redis://", "rediss://", "unix://")):
                raise SettingError(f"{mask(str(value))!r} must start with redis://, rediss:// or unix://")
            return value
        if name in ("namespace", "default_pool"):
            return check_name("namespace" if name == "namespace" else "pool", value)
        if name == "cluster":
            return settings.getbool(setting)
        return value
    except (SettingError, ValueError) as exc:
        raise InputError(f"{setting} in the Scrapy project's settings: {exc}") from None


def _json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=False))


def _tag_options(f: Callable) -> Callable:
    f = click.option("--country", help="Tag: two-letter country code.")(f)
    f = click.option("--provider", help="Tag: provider name.")(f)
    f = click.option("--type", "type_", type=click.Choice(PROXY_TYPES), help="Tag: proxy type.")(f)
    return f


def _tags(type_: str | None, provider: str | None, country: str | None) -> dict[str, str]:
    raw = {"type": type_ or "", "provider": provider or "", "country": country or ""}
    try:
        return check_tags(raw)
    except ProxyURLError as exc:
        raise InputError(str(exc)) from None


# --- changing the pool ---------------------------------------------------------------------------

@cli.command()
@click.argument("source", type=click.File("rb"))
@click.option("--partial", is_flag=True, help="Load the valid lines even if some lines are bad.")
@click.option("--dry-run", is_flag=True, help="Validate only; change nothing.")
@_tag_options
@click.pass_obj
def load(obj: Ctx, source: Any, partial: bool, dry_run: bool, type_: str | None, provider: str | None,
         country: str | None) -> None:
    """Load proxies from FILE ('-' for stdin): one per line, or CSV with a header url,type,provider,country.

    Every bad line is reported with its number; nothing is loaded from a file with errors unless
    --partial. Duplicates are merged. Running crawls use the new proxies at once.
    """
    name = getattr(source, "name", "-")
    name = "<stdin>" if name in ("-", "<stdin>") or not isinstance(name, str) else name
    parsed = parse_proxy_list(_utf8(source.read(), name), tags=_tags(type_, provider, country))
    for error in parsed.errors:
        click.echo(f"{name}:{error.line}: {error.message}", err=True)
    if parsed.errors and not partial:
        raise InputError(f"nothing loaded: {len(parsed.errors)} bad line(s) in {name} (fix them, or pass "
                         f"--partial to load the {len(parsed.proxies)} valid one(s))")
    if not parsed.proxies:
        raise InputError(f"no proxies in {name}")
    for note in parsed.replaced:
        click.echo(f"{name}: warning: {note}", err=True)
    merged = f", {parsed.duplicates} duplicate line(s) merged" if parsed.duplicates else ""
    skipped = f", {len(parsed.errors)} bad line(s) skipped" if parsed.errors else ""
    if dry_run:
        click.echo(f"{name}: {len(parsed.proxies)} valid proxies{merged}{skipped} (dry run: nothing loaded)")
        return
    result = obj.store.add_proxies(obj.target_pool, parsed.proxies)
    replaced = len(result.replaced)
    click.echo(f"pool {obj.target_pool!r}: {len(parsed.proxies)} proxies loaded ({result.added} new, "
               f"{_replaced(replaced)}{result.updated - replaced} already there){merged}{skipped}")


def _utf8(data: bytes, name: str) -> str:
    """A list file's text, or InputError naming the file and the line of the first byte that is not UTF-8."""
    try:
        return decode_proxy_list(data, name)
    except ProxyURLError as exc:
        raise InputError(str(exc)) from None


def _ban_ttl(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """--ttl: a finite number of seconds from 0.001 to MAX_BAN_TTL, checked before anything is written."""
    if value is not None and not 0.001 <= value <= MAX_BAN_TTL:  # also false for nan
        raise click.BadParameter(f"{value!r} must be a number of seconds from 0.001 to {MAX_BAN_TTL:.0f} "
                                 "(ten years; `remove` takes a proxy out for good)")
    return value


@cli.command()
@click.argument("urls", nargs=-1, required=True)
@_tag_options
@click.pass_obj
def add(obj: Ctx, urls: tuple[str, ...], type_: str | None, provider: str | None, country: str | None) -> None:
    """Add the proxies URL... (any form a list file accepts, gateway entries `<template>#sessions=N` too)."""
    tags = _tags(type_, provider, country)
    entries, errors = [], []
    for n, url in enumerate(urls, start=1):
        try:
            entries.extend((f"argument {n}", proxy) for proxy in expand_entry(url, tags))
        except ProxyURLError as exc:
            errors.append(f"argument {n}: {exc}")
    for error in errors:
        click.echo(error, err=True)
    if errors:
        raise InputError(f"nothing added: {len(errors)} bad proxy URL(s)")
    by_id, notes = merge_exits(entries)
    for note in notes:
        click.echo(f"warning: {note}", err=True)
    proxies = list(by_id.values())
    result = obj.store.add_proxies(obj.target_pool, proxies)
    click.echo(f"pool {obj.target_pool!r}: {_add_summary(result)}")
    for p in proxies:
        click.echo(f"  {p.id}  {masked_slot(p)}" + ("  (replaced: same exit, new URL)" if p.id in result.replaced
                                                    else ""))


def _add_summary(result: Any) -> str:
    """``N added, [M replaced, ]K already there``: replaced = an exit in the pool whose URL the add changed."""
    replaced = len(result.replaced)
    return f"{result.added} added, {_replaced(replaced)}{result.updated - replaced} already there"


def _replaced(n: int) -> str:
    return f"{n} replaced, " if n else ""


@cli.command()
@click.argument("proxies", nargs=-1, required=True)
@click.pass_obj
def remove(obj: Ctx, proxies: tuple[str, ...]) -> None:
    """Drain PROXY... (id, or URL with or without credentials) out of the pool.

    A gateway entry (`<template>#sessions=N`) names its N slots. No new leases from now on; requests and
    sticky sessions that hold one finish normally.
    """
    refs: list[str] = []
    for ref in proxies:
        if not is_gateway_entry(ref):
            refs.append(ref)
            continue
        try:
            refs.extend(p.id for p in parse_gateway(ref).slots())  # a slot's id does not depend on its token
        except ProxyURLError as exc:
            raise InputError(str(exc)) from None
    found, missing = _resolve(obj, tuple(refs))
    removed = obj.store.remove_proxies(obj.target_pool, list(dict.fromkeys(found.values())))
    click.echo(f"pool {obj.target_pool!r}: {removed} proxies drained (no new leases; running ones finish)")
    _fail_missing(obj, missing)


@cli.command()
@click.argument("proxy")
@click.option("--site", help="Quarantine on this site only (a domain or site group); default: every site.")
@click.option("--ttl", type=float, callback=_ban_ttl, help="Seconds (default: 1800 on a site, 300 proxy-wide; "
              "repeated bans escalate).")
@click.option("--reason", default="manual", show_default=True, help="Reason shown in status and metrics.")
@click.pass_obj
def ban(obj: Ctx, proxy: str, site: str | None, ttl: float | None, reason: str) -> None:
    """Quarantine PROXY (id or URL) for every host at once, on one site or proxy-wide."""
    pid = _resolve_one(obj, proxy)
    scope = _site_key(obj, site)
    store = obj.store
    if ttl is not None:  # an explicit TTL is what the operator gets, strikes or not
        store.bans_options = dataclasses.replace(store.bans_options, max_ttl=ttl)
    result = store.ban(obj.target_pool, pid, site=scope, reason=reason, ttl=ttl)
    left = result.until - store.server_time()
    where = f"on {scope}" if scope else "proxy-wide"
    if result.started:
        click.echo(f"proxy {pid} ({_masked(obj, pid)}) quarantined {where} for {views.duration(left)} "
                   f"(strike {result.strikes}, reason {reason})")
    else:
        click.echo(f"proxy {pid} ({_masked(obj, pid)}) already quarantined {where}: {views.duration(left)} left "
                   f"(strike {result.strikes}; no extra strike)")


@cli.command()
@click.argument("proxy", required=False)
@click.option("--site", help="Lift the quarantine on this site; default: the proxy-wide one.")
@click.option("--all", "all_", is_flag=True, help="Lift every quarantine of PROXY (every site and proxy-wide); "
              "without PROXY, every quarantine of the pool (asks first).")
@click.option("--yes", "-y", is_flag=True, help="With --all and no PROXY: do not ask before lifting.")
@click.pass_obj
def unban(obj: Ctx, proxy: str | None, site: str | None, all_: bool, yes: bool) -> None:
    """Lift a quarantine of PROXY (id or URL) now, or with --all and no PROXY every quarantine of the
    pool; the strikes are forgotten too."""
    if all_ and site:
        raise click.UsageError("--site and --all exclude each other")
    if proxy is None:
        if not all_:
            raise click.UsageError("name a PROXY, or pass --all to lift every quarantine of the pool")
        _unban_pool(obj, yes)
        return
    pid = _resolve_one(obj, proxy)
    store = obj.store
    if all_:
        scopes = sorted({b.scope for b in store.bans(obj.target_pool) if b.proxy_id == pid})
    else:
        scopes = [_site_key(obj, site) or "*"]
    lifted = [s for s in scopes if store.unban(obj.target_pool, pid, site=None if s == "*" else s)]
    shown = ", ".join("proxy-wide" if s == "*" else s for s in lifted)
    if lifted:
        click.echo(f"proxy {pid} ({_masked(obj, pid)}): quarantine lifted ({shown})")
    else:
        where = "on any site" if all_ else ("proxy-wide" if scopes == ["*"] else f"on {scopes[0]}")
        click.echo(f"proxy {pid} ({_masked(obj, pid)}): no quarantine {where}")


def _confirm_on_stderr(question: str) -> None:
    """Ask on stderr, read the answer from stdin, abort unless it is yes. Not ``click.confirm(err=True)``:
    click < 8.4 writes the prompt's last character to stdout, into a script's piped output."""
    click.echo(f"{question} [y/N]: ", nl=False, err=True)
    answer = sys.stdin.readline()
    if answer.strip().lower() not in ("y", "yes"):
        raise click.Abort()


def _unban_pool(obj: Ctx, yes: bool) -> None:
    """``unban --all``: every quarantine entry of the pool (running ones, and ended ones whose strikes are
    remembered for escalation), after a confirmation on stderr that says how many."""
    pool, store = obj.target_pool, obj.store
    if pool not in store.pools() and store.pool_size(pool) == 0:
        raise OperationalError(f"pool {pool!r} does not exist in namespace {obj.namespace!r}")
    entries = store.bans(pool)
    now = store.server_time()
    running = [b for b in entries if b.until > now]
    if not entries:
        click.echo(f"pool {pool!r}: no quarantine to lift")
        return
    wide = sum(1 for b in running if b.scope == "*")
    what = (f"{len(running)} running quarantine(s) of pool {pool!r} ({len(running) - wide} on a site, {wide} "
            f"proxy-wide; {len({b.proxy_id for b in running})} proxies)")
    ended = len(entries) - len(running)
    if ended:
        what += f" and forget the strikes of {ended} ended one(s)"
    if not yes:
        _confirm_on_stderr(f"Lift {what}?")
    lifted = sum(1 for b in entries if store.unban(pool, b.proxy_id, site=None if b.scope == "*" else b.scope))
    click.echo(f"pool {pool!r}: {len(running)} quarantine(s) lifted ({len(running) - wide} on a site, {wide} "
               f"proxy-wide), {lifted} entries cleared (strikes forgotten)")


# --- views -----------------------------------------------------------------------------------------

@cli.command("list")
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def list_(obj: Ctx, as_json: bool) -> None:
    """Every proxy: id, masked URL, tags and counters (leases, ok, errors, quarantines, EWMA latency)."""
    pools = obj.view_pools()
    records = {pool: obj.store.list_proxies(pool) for pool in pools}
    if as_json:
        _json([row for pool in pools for row in views.proxies_json(pool, records[pool])])
        return
    rows = [(pool, r) for pool in pools for r in records[pool]]
    if not rows:
        click.echo("no proxies")
        return
    click.echo("\n\n".join(views.proxies_table(pool, records[pool]) for pool in pools if records[pool]))


@cli.command()
@click.option("--proxies", is_flag=True, help="Add one row per proxy and site (state, ban time left, reason).")
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def status(obj: Ctx, proxies: bool, as_json: bool) -> None:
    """Per pool: free / leased / session / cooling / banned slots per site, success, latency, hosts."""
    click.echo(_status(obj, proxies, as_json))


def _status(obj: Ctx, proxies: bool, as_json: bool) -> str:
    snaps = [read_pool(obj.store, pool, detail=proxies) for pool in obj.view_pools()]
    if as_json:
        return json.dumps([views.status_json(s, proxies=proxies) for s in snaps], indent=2)
    return "\n\n".join(views.status_text(s, proxies=proxies) for s in snaps)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def tiers(obj: Ctx, as_json: bool) -> None:
    """Tiered pools: per tier, sites on it, requests, pages, bans; the sites off the cheapest tier."""
    rows = []
    for tier_list in obj.store.tier_lists():
        sites = obj.store.tier_sites(tier_list)
        for i, c in enumerate(obj.store.tier_counts(tier_list)):
            rows.append({"tiers": ">".join(tier_list), "tier": i + 1, "pool": c.pool, "sites_now": c.sites,
                         "requests": c["l"], "pages": c["ok"], "bans": c["ban"], "moved_up": c["up"],
                         "moved_down": c["down"], "probes": c["probe"], "probes_banned": c["pban"],
                         "sites": [site for site, t in sites.items() if t == i] if i else []})
    if as_json:
        _json(rows)
        return
    if not rows:
        click.echo("no tier lists in this namespace (PROXY_SHARD_TIERS)")
        return
    head = ("tiers", "tier", "pool", "sites now", "requests", "pages", "bans", "up", "down", "probes (banned)")
    body = [(r["tiers"], str(r["tier"]), r["pool"], str(r["sites_now"]), str(r["requests"]), str(r["pages"]),
             str(r["bans"]), str(r["moved_up"]), str(r["moved_down"]), f"{r['probes']} ({r['probes_banned']})")
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    for line in (head, *body):
        click.echo("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
    for r in rows:
        if r["sites"]:
            click.echo(f"{r['tiers']}: on {r['pool']!r} (tier {r['tier']}): {', '.join(r['sites'])}")


@cli.command()
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, help="Seconds.")
@click.option("--proxies", is_flag=True, help="Add one row per proxy and site.")
@click.option("--iterations", type=click.IntRange(min=0), default=0, help="Stop after N refreshes (0: never).")
@click.pass_obj
def watch(obj: Ctx, interval: float, proxies: bool, iterations: int) -> None:
    """Refresh `status` every --interval seconds until Ctrl-C."""
    clear = sys.stdout.isatty()
    n = 0
    try:
        while True:
            text = _status(obj, proxies, False)
            if clear:
                click.clear()
            stamp = time.strftime("%H:%M:%S")
            click.echo(f"every {interval:g}s, {stamp} (Ctrl-C to stop)\n\n{text}\n")
            n += 1
            if iterations and n >= iterations:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


@cli.command()
@click.option("--site", help="Only this site.")
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def sessions(obj: Ctx, site: str | None, as_json: bool) -> None:
    """Live sticky sessions: site, session id, proxy, uses, time to live, host."""
    rows = [s for pool in obj.view_pools() for s in views.sessions_json(read_pool(obj.store, pool, detail=True))
            if site is None or s["site"] == site]
    _show(rows, as_json, views.sessions_table, "no live sessions")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts (adds the per-minute load).")
@click.pass_obj
def hosts(obj: Ctx, as_json: bool) -> None:
    """Live Scrapy processes: heartbeat age, requests, success, slots held, share of the load."""
    rows = [h for pool in obj.view_pools() for h in views.hosts_json(read_pool(obj.store, pool))]
    _show(rows, as_json, views.hosts_table, "no live hosts")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.pass_obj
def pools(obj: Ctx, as_json: bool) -> None:
    """Every pool of the namespace: proxies, dead, banned, sites, live hosts, slots held."""
    rows = [views.pools_json(read_pool(obj.store, pool)) for pool in obj.view_pools()]
    _show(rows, as_json, views.pools_table, None)


def _warmup(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """--warmup: a finite number of seconds from 0 to MAX_LEASE_TTL, checked before anything is written."""
    if not 0 <= value <= MAX_LEASE_TTL:  # also false for nan
        raise click.BadParameter(f"{value!r} must be a number of seconds from 0 to {MAX_LEASE_TTL:.0f} "
                                 "(the longest lease TTL of the crawls using the pool)")
    return value


@cli.command()
@click.option("--warmup", type=float, default=MIGRATE_SAFE_WARMUP, show_default=True, callback=_warmup,
              help="Seconds every proxy re-keyed to its exit id rests proxy-wide: at least the longest lease "
                   "TTL of the crawls using the pool (max(60, DOWNLOAD_TIMEOUT + 30), or PROXY_SHARD_LEASE_TTL).")
@click.pass_obj
def migrate(obj: Ctx, warmup: float) -> None:
    """Bring the pools (or --pool) written by an older version onto the current Redis layout now.

    The first lease on such a pool does it by itself (a page at a time, never blocking Redis); this
    runs it ahead of a crawl. Idempotent: a pool already current is left alone. A proxy whose id
    changes (layout 3: one id per exit) rests --warmup seconds: a request sent through its old id may
    still run until its lease expires, and its new id must not be leased on that site meanwhile.
    """
    for pool in obj.view_pools():
        done = obj.store.migrate(pool, warmup=warmup)
        click.echo(f"pool {pool!r}: {'migrated' if done else 'already on the current layout'}")


@cli.command()
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--top-sites", type=int, default=DEFAULTS["PROXY_SHARD_METRICS_TOP_SITES"], show_default=True,
              help="Per pool, the most active sites shown one by one; the rest are summed as site=\"_other\".")
@click.pass_obj
def metrics(obj: Ctx, port: int, host: str, top_sites: int) -> None:
    """Serve Prometheus metrics on http://HOST:PORT/metrics, read from Redis at each scrape.

    Redis down (at start or later) is not an error here: the exporter keeps serving with
    ``proxy_shard_up 0``, which is what an alert watches, and reports ``1`` again once Redis answers.
    """
    from scrapy_proxy_shard.ops.exporter import serve

    pools = [obj.pool] if obj.pool else None
    top_sites = ShardSettings.from_settings({"PROXY_SHARD_METRICS_TOP_SITES": top_sites}).metrics_top_sites
    stop = threading.Event()
    # Before the server answers: a SIGTERM right after the first scrape must stop it cleanly.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        server, _thread = serve(obj.store, host=host, port=port, pools=pools, top_sites=top_sites)
    except OSError as exc:
        raise OperationalError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = server.server_address[1]
    click.echo(f"serving http://{host}:{bound}/metrics (pools: {obj.pool or 'all'}, namespace "
               f"{obj.namespace!r}); Ctrl-C to stop", err=True)
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()


def _show(rows: list, as_json: bool, table, empty: str | None) -> None:
    """Rows as JSON for scripts, or as a table for people (``empty`` when there are none)."""
    if as_json:
        _json(rows)
    else:
        click.echo(table(rows) if rows or empty is None else empty)


# --- resolving proxies ---------------------------------------------------------------------------

def _resolve(obj: Ctx, refs: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Map each reference (id, URL, or URL without its credentials) to a proxy id of the pool."""
    pool, store = obj.target_pool, obj.store
    candidates: dict[str, str] = {}
    for ref in refs:
        text = ref.strip()
        candidates[ref] = text if _is_id(text) else Proxy(parse_proxy(text)).id
    urls = store.proxy_urls(pool, set(candidates.values()))
    found = {ref: pid for ref, pid in candidates.items() if urls.get(pid)}
    missing = [ref for ref in refs if ref not in found]
    if missing and any(not _is_id(ref.strip()) for ref in missing):
        by_address: dict[str, list[str]] = {}
        for record in store.list_proxies(pool):
            by_address.setdefault(split_credentials(record.proxy.url)[0], []).append(record.id)
        for ref in [m for m in missing if not _is_id(m.strip())]:
            ids = by_address.get(split_credentials(parse_proxy(ref))[0], [])
            if len(ids) > 1:
                raise InputError(f"{mask(ref)} matches {len(ids)} proxies of pool {pool!r} "
                                 f"({', '.join(ids)}): name one by id")
            if ids:
                found[ref] = ids[0]
                missing.remove(ref)
    return found, missing


def _resolve_one(obj: Ctx, ref: str) -> str:
    found, missing = _resolve(obj, (ref,))
    if missing:
        _fail_missing(obj, missing)
    return found[ref]


def _fail_missing(obj: Ctx, missing: list[str]) -> None:
    if missing:
        shown = ", ".join(mask(m) for m in missing)
        raise OperationalError(f"not in pool {obj.target_pool!r} (namespace {obj.namespace!r}): {shown}")


def _masked(obj: Ctx, pid: str) -> str:
    url = obj.store.proxy_urls(obj.target_pool, [pid]).get(pid)
    return mask(url) if url else "removed"


def _site_key(obj: Ctx, site: str | None) -> str | None:
    """A site as the crawls key it: a site the pool knows (domain or group) as is, else its
    registrable domain (``www.shop.co.uk`` -> ``shop.co.uk``)."""
    if site is None:
        return None
    text = site.strip().lower()
    if SITE_KEY_RE.fullmatch(text) and text in obj.store.sites(obj.target_pool):
        return text
    return check_site(site, "--site")


def _is_id(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point (``scrapy-proxy-shard``)."""
    cli.main(args=argv, prog_name="scrapy-proxy-shard")
    raise SystemExit(0)  # cli.main exits itself in standalone mode; this line is for type checkers
