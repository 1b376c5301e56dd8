"""The operator CLI against a real redis-server: through the real entry point (``python -m
scrapy_proxy_shard`` in a subprocess) for loading, errors and exit codes, and through click's runner
for the many views (same code, no process start per call)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import redis
from click.testing import CliRunner

from scrapy_proxy_shard.demo.redis_server import RedisServer, free_port
from scrapy_proxy_shard.engine.store import Lease, LeaseWait, PoolStore
from scrapy_proxy_shard.ops.cli import cli
from scrapy_proxy_shard.ops.snapshot import read_pool

NS = "clitest"
GOOD = """\
# datacenter proxies
http://alice:Pw-Alice-77@10.1.0.1:3128
10.1.0.2:3128

10.1.0.3:3128:bob:Pw-Bob-88
http://alice:Pw-Alice-77@10.1.0.1:3128
"""
BAD = """\
http://alice:Pw-Alice-77@10.1.0.1:3128
ftp://carol:Pw-Carol-99@10.1.0.9:21
# a comment
10.1.0.4
http://dave:Pw-Dave-11@10.1.0.5:99999
10.1.0.6:3128
"""
CSV = """\
url,type,provider,country
http://erin:Pw-Erin-22@10.2.0.1:8080,residential,Acme,de
10.2.0.2:8080,mobile,,us
"""
SECRETS = ("Pw-Alice-77", "Pw-Bob-88", "Pw-Carol-99", "Pw-Dave-11", "Pw-Erin-22")


@pytest.fixture
def env(redis_server, real_redis):
    return {**os.environ, "PROXY_SHARD_REDIS_URL": redis_server.url, "PROXY_SHARD_NAMESPACE": NS}


@pytest.fixture
def store(real_redis):
    return PoolStore(real_redis, namespace=NS, host_id="host-a")


def run(env, *args, stdin: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    """The real entry point, in its own process."""
    proc = subprocess.run([sys.executable, "-m", "scrapy_proxy_shard", *args], env=env, input=stdin,
                          capture_output=True, text=True, timeout=60, cwd=cwd)
    assert not any(s in proc.stdout + proc.stderr for s in SECRETS), proc.stdout + proc.stderr
    return proc


def invoke(env, *args, stdin: str | None = None):
    """The same CLI in this process (click's runner)."""
    result = CliRunner().invoke(cli, list(args), env={k: env[k] for k in ("PROXY_SHARD_REDIS_URL",
                                                                           "PROXY_SHARD_NAMESPACE")},
                                input=stdin, catch_exceptions=False)
    assert not any(s in result.stdout + result.stderr for s in SECRETS), result.stdout + result.stderr
    return result


# --- load / add / remove ------------------------------------------------------------------------------

def test_load_a_good_file_merges_duplicates_and_masks(env, tmp_path, store):
    path = tmp_path / "proxies.txt"
    path.write_text(GOOD)
    proc = run(env, "load", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "pool 'default': 3 proxies loaded (3 new, 0 already there), 1 duplicate line(s) merged" in proc.stdout
    assert store.pool_size("default") == 3
    listed = run(env, "list")
    assert listed.returncode == 0
    assert "http://***:***@10.1.0.1:3128" in listed.stdout and "http://***:***@10.1.0.3:3128" in listed.stdout
    again = run(env, "load", str(path))
    assert "(0 new, 3 already there)" in again.stdout


def test_load_a_bad_file_names_every_bad_line_and_loads_nothing(env, tmp_path, store):
    path = tmp_path / "bad.txt"
    path.write_text(BAD)
    proc = run(env, "load", str(path))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{path}:")]
    assert [e.split(":")[1] for e in errors] == ["2", "4", "5"]
    assert "unsupported scheme 'ftp'" in errors[0] and "missing port" in errors[1] and "out of range" in errors[2]
    assert "nothing loaded: 3 bad line(s)" in proc.stderr and "--partial" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert store.pools() == [] and store.pool_size("default") == 0
    partial = run(env, "--pool", "dc", "load", "--partial", str(path))
    assert partial.returncode == 0
    assert "2 proxies loaded (2 new, 0 already there), 3 bad line(s) skipped" in partial.stdout
    assert store.pool_size("dc") == 2


def test_load_csv_with_tags_from_stdin(env, store):
    proc = run(env, "--pool", "res", "load", "-", stdin=CSV)
    assert proc.returncode == 0, proc.stderr
    tags = {r.proxy.masked: r.proxy.tags for r in store.list_proxies("res")}
    assert tags == {"http://***:***@10.2.0.1:8080": {"type": "residential", "provider": "Acme", "country": "DE"},
                    "http://10.2.0.2:8080": {"type": "mobile", "country": "US"}}
    bad = run(env, "load", "-", stdin="url,kind\nhttp://10.0.0.1:1,x\n")
    assert bad.returncode == 2 and "<stdin>:1: CSV header" in bad.stderr


def test_add_validates_every_argument_and_remove_drains(env, store):
    bad = invoke(env, "add", "http://x:Pw-Dave-11@10.3.0.1:1", "nohost", "10.3.0.2:99999")
    assert bad.exit_code == 2
    assert "argument 2:" in bad.stderr and "argument 3:" in bad.stderr and store.pool_size("default") == 0
    ok = invoke(env, "add", "--type", "datacenter", "http://x:Pw-Dave-11@10.3.0.1:1", "10.3.0.2:2")
    assert ok.exit_code == 0 and "2 added, 0 already there" in ok.stdout
    held = store.lease("default", "a.example", ttl=30)
    assert isinstance(held, Lease)
    # By URL without its credentials: an operator need not type a password to drain a proxy.
    target = "10.3.0.1:1" if "10.3.0.1" in held.masked_url else "10.3.0.2:2"
    removed = invoke(env, "remove", target)
    assert removed.exit_code == 0 and "1 proxies drained" in removed.stdout
    assert store.release(held).status == "ok"  # the running lease finishes normally
    for _ in range(3):
        lease = store.lease("default", "a.example", ttl=30)
        assert isinstance(lease, Lease) and lease.proxy_id != held.proxy_id
        store.release(lease)
    missing = invoke(env, "remove", "0123456789abcdef")
    assert missing.exit_code == 1 and "not in pool 'default'" in missing.stderr


# --- status and the other views ---------------------------------------------------------------------------

@pytest.fixture
def busy_pool(store, make_host):
    """Two hosts with leases held, a cooling slot, a ban and a sticky session."""
    store.add_proxies("default", ["http://alice:Pw-Alice-77@10.1.0.1:3128", "10.1.0.2:3128", "10.1.0.3:3128",
                                  "10.1.0.4:3128"])
    a, b = make_host("host-a"), make_host("host-b")
    a.heartbeat("default", ttl=60, info={"spider": "shop"})
    b.heartbeat("default", ttl=60, info={"spider": "shop"})
    held = [a.lease("default", "shop.example", ttl=60), b.lease("default", "shop.example", ttl=60)]
    banned = b.lease("default", "shop.example", ttl=60)
    b.release(banned, outcome="ban", reason="http_403")
    session = a.lease("default", "other.example", ttl=60, session_id="cart-42")
    a.release(session, outcome="ok", latency=0.25)
    a.heartbeat("default", ttl=60, info={"spider": "shop"})
    b.heartbeat("default", ttl=60, info={"spider": "shop"})
    return {"held": held, "banned": banned, "session": session}


@pytest.fixture
def make_host(real_redis):
    return lambda host: PoolStore(real_redis, namespace=NS, host_id=host)


def test_status_while_leases_are_held(env, busy_pool):
    result = invoke(env, "status", "--json")
    assert result.exit_code == 0, result.stderr
    [pool] = json.loads(result.stdout)
    shop = next(s for s in pool["sites"] if s["site"] == "shop.example")
    assert (shop["slots"], shop["free"], shop["leased"], shop["banned"]) == (4, 1, 2, 1)
    assert pool["banned"] == 1 and pool["live_hosts"] == 2
    assert pool["requests"]["banned"] == 1 and pool["requests"]["ok"] == 1
    held = {h["host"]: h["held"] for h in pool["hosts"]}
    assert held == {"host-a": 2, "host-b": 1}  # host-a: a lease and the sticky session
    assert pool["quarantines"]["running_by_scope_reason"] == [{"scope": "shop.example", "reason": "http_403",
                                                               "count": 1}]
    text = invoke(env, "status").stdout
    assert "pool 'default': 4 proxies (4 active, 0 dead), 1 banned on some site, 2 live hosts" in text
    assert "shop.example" in text and "host-a" in text and "host-b" in text


def test_status_per_proxy_shows_state_ban_reason_and_strikes(env, busy_pool):
    result = invoke(env, "status", "--proxies", "--json")
    rows = json.loads(result.stdout)[0]["proxies_by_site"]
    banned = next(r for r in rows if r["id"] == busy_pool["banned"].proxy_id and r["site"] == "shop.example")
    assert banned["state"] == "banned" and banned["ban_reason"] == "http_403" and banned["strikes"] == 1
    assert 1000 < banned["free_in"] <= 1800
    leased = {r["id"]: r for r in rows if r["state"] == "leased"}
    assert {lease.proxy_id for lease in busy_pool["held"]} == set(leased)
    text = invoke(env, "status", "--proxies").stdout
    assert "http_403" in text and "http://***:***@10.1.0.1:3128" in text


def test_sessions_hosts_and_pools(env, busy_pool):
    sessions = json.loads(invoke(env, "sessions", "--json").stdout)
    assert [(s["site"], s["session"], s["uses"], s["host"]) for s in sessions] == \
        [("other.example", "cart-42", 1, "host-a")]
    assert 500 < sessions[0]["ttl_left"] <= 600
    assert "cart-42" in invoke(env, "sessions").stdout
    hosts = json.loads(invoke(env, "hosts", "--json").stdout)
    assert {h["host"]: h["requests"] for h in hosts} == {"host-a": 2, "host-b": 2}
    assert all(h["info"]["spider"] == "shop" and h["heartbeat_age"] < 30 for h in hosts)
    assert sum(h["share"] for h in hosts) == pytest.approx(1.0)
    assert "host-a" in invoke(env, "hosts").stdout
    [pool] = json.loads(invoke(env, "pools", "--json").stdout)
    assert pool == {"pool": "default", "proxies": 4, "active": 4, "dead": 0, "banned": 1, "sites": 2,
                    "live_hosts": 2, "held": 3, "success_ratio": 0.5}


def test_ban_and_unban_per_site_and_proxy_wide(env, store):
    store.add_proxies("default", ["http://alice:Pw-Alice-77@10.1.0.1:3128", "10.1.0.2:3128"])
    target = next(r for r in store.list_proxies("default") if "10.1.0.1" in r.proxy.masked)
    banned = invoke(env, "ban", target.id, "--site", "www.shop.example", "--ttl", "120", "--reason", "looks odd")
    assert banned.exit_code == 0, banned.stderr
    assert f"proxy {target.id} (http://***:***@10.1.0.1:3128) quarantined on shop.example for 2m00s" in banned.stdout
    for _ in range(3):  # every lease on that site goes to the other proxy
        lease = store.lease("default", "shop.example", ttl=5)
        assert isinstance(lease, Lease) and lease.proxy_id != target.id
        store.release(lease)
    assert [b.reason for b in store.bans("default")] == ["looks_odd"]
    lifted = invoke(env, "unban", target.id, "--site", "shop.example")
    assert "quarantine lifted (shop.example)" in lifted.stdout
    wide = invoke(env, "ban", "10.1.0.2:3128")  # by address, proxy-wide, default TTL
    assert wide.exit_code == 0 and "quarantined proxy-wide for 5m00s" in wide.stdout
    other = store.lease("default", "any.example", ttl=5)
    assert isinstance(other, Lease) and other.proxy_id == target.id
    assert isinstance(store.lease("default", "any.example", ttl=5), LeaseWait)
    store.release(other)
    assert "no quarantine on shop.example" in invoke(env, "unban", target.id, "--site", "shop.example").stdout
    assert "quarantine lifted (proxy-wide)" in invoke(env, "unban", "--all", "10.1.0.2:3128").stdout
    unknown = invoke(env, "ban", "http://zed:Pw-Dave-11@10.9.9.9:1")
    assert unknown.exit_code == 1 and "http://***:***@10.9.9.9:1" in unknown.stderr


def test_status_shows_a_proxy_wide_quarantine_as_banned_on_every_site(env, store):
    """A proxy-wide quarantine is not written into the sites' slots (leases check it): the per-proxy
    rows must still say banned, with the time until it ends, not free."""
    store.add_proxies("default", ["10.1.0.2:3128", "10.1.0.3:3128"])
    for site in ("shop.example", "other.example"):  # both sites learnt the pool, every slot free again
        store.release(store.lease("default", site, ttl=5))
    wide = invoke(env, "ban", "10.1.0.2:3128", "--ttl", "300", "--reason", "dead")
    assert wide.exit_code == 0, wide.stderr
    target = next(r.id for r in store.list_proxies("default") if "10.1.0.2" in r.proxy.masked)
    rows = json.loads(invoke(env, "status", "--proxies", "--json").stdout)[0]["proxies_by_site"]
    mine = [r for r in rows if r["id"] == target]
    assert sorted(r["site"] for r in mine) == ["other.example", "shop.example"]
    for row in mine:
        assert (row["state"], row["ban_scope"], row["ban_reason"]) == ("banned", "*", "dead"), row
        assert 250 < row["free_in"] <= 300
    assert {r["state"] for r in rows if r["id"] != target} == {"free"}
    text = invoke(env, "status", "--proxies").stdout
    banned_lines = [line for line in text.splitlines() if target in line]
    assert len(banned_lines) == 2 and all("banned" in line and "proxy-wide" in line for line in banned_lines)
    invoke(env, "unban", "10.1.0.2:3128")
    rows = json.loads(invoke(env, "status", "--proxies", "--json").stdout)[0]["proxies_by_site"]
    assert {r["state"] for r in rows} == {"free"}


def test_unban_all_without_a_proxy_lifts_every_quarantine_of_the_pool_after_asking(env, store):
    store.add_proxies("default", ["http://alice:Pw-Alice-77@10.1.0.1:3128", "10.1.0.2:3128", "10.1.0.3:3128"])
    store.add_proxies("other", ["10.1.0.9:3128"])
    for ref, site in (("10.1.0.1:3128", "shop.example"), ("10.1.0.1:3128", "b.example"), ("10.1.0.2:3128", None)):
        assert invoke(env, "ban", ref, *(("--site", site) if site else ())).exit_code == 0
    assert invoke(env, "--pool", "other", "ban", "10.1.0.9:3128").exit_code == 0
    assert len(store.bans("default")) == 3

    no = run(env, "unban", "--all", stdin="n\n")  # the real prompt, in its own process
    assert no.returncode == 1 and "Aborted" in no.stderr
    assert ("Lift 3 running quarantine(s) of pool 'default' (2 on a site, 1 proxy-wide; 2 proxies)?"
            in no.stderr), no.stderr
    assert no.stdout == "" and len(store.bans("default")) == 3  # the prompt is on stderr; nothing lifted

    yes = invoke(env, "unban", "--all", stdin="y\n")
    assert yes.exit_code == 0, yes.stderr
    assert "pool 'default': 3 quarantine(s) lifted (2 on a site, 1 proxy-wide)" in yes.stdout
    assert store.bans("default") == [] and len(store.bans("other")) == 1  # one pool only
    for _ in range(3):  # every proxy leases again on the site it was banned from
        lease = store.lease("default", "shop.example", ttl=5)
        assert isinstance(lease, Lease)
    assert "pool 'default': no quarantine to lift" in invoke(env, "unban", "--all").stdout

    quiet = invoke(env, "--pool", "other", "unban", "--all", "--yes")  # --yes: no question asked
    assert quiet.exit_code == 0 and "Lift" not in quiet.stderr and "1 quarantine(s) lifted" in quiet.stdout
    assert store.bans("other") == []
    bare = invoke(env, "unban")
    assert bare.exit_code == 2 and "--all" in bare.stderr
    assert invoke(env, "--pool", "nope", "unban", "--all", "--yes").exit_code == 1


def test_version_is_the_packages_one(env):
    from scrapy_proxy_shard import __version__

    for args in (["--version"], ["-V"]):
        proc = run(env, *args)
        assert proc.returncode == 0 and proc.stdout.strip() == f"scrapy-proxy-shard, version {__version__}"
        assert proc.stderr == ""


def _project(root, settings: str, module: str = "projx"):
    """A Scrapy project as `scrapy startproject` lays it out: scrapy.cfg naming module.settings."""
    (root / module).mkdir(parents=True)
    (root / "scrapy.cfg").write_text(f"[settings]\ndefault = {module}.settings\n")
    (root / module / "__init__.py").write_text("")
    (root / module / "settings.py").write_text(f'BOT_NAME = "{module}"\n' + settings)
    (root / module / "spiders").mkdir()
    (root / module / "spiders" / "__init__.py").write_text("")
    return root


def _project_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROXY_SHARD_", "SCRAPY_")) and k != "REDIS_URL"}
    return {**env, **extra}


def test_inside_a_scrapy_project_its_settings_are_used_and_said(tmp_path, redis_server, real_redis):
    project = _project(tmp_path / "proj", f'PROXY_SHARD_REDIS_URL = "{redis_server.url}"\n'
                                          'PROXY_SHARD_NAMESPACE = "projns"\nPROXY_SHARD_POOL = "dc"\n')
    inside = project / "projx" / "spiders"  # scrapy.cfg is found upward, as `scrapy` commands find it
    added = run(_project_env(), "add", "10.1.0.7:3128", cwd=inside)
    assert added.returncode == 0, added.stderr
    assert "pool 'dc': 1 added" in added.stdout
    said = added.stderr.strip().splitlines()
    assert said == [f"scrapy-proxy-shard: Scrapy project projx.settings: Redis {redis_server.url} (project), "
                    "namespace 'projns' (project), pool for changes 'dc' (project)"]
    assert PoolStore(real_redis, namespace="projns").pool_size("dc") == 1
    # Views still show every pool of the namespace (the project's pool is where changes go, not a filter).
    PoolStore(real_redis, namespace="projns").add_proxies("res", ["10.1.0.8:3128"])
    listed = run(_project_env(), "pools", "--json", cwd=project)
    assert listed.returncode == 0 and listed.stdout, listed.stderr  # (once seen empty under load: say why)
    pools = json.loads(listed.stdout)
    assert [p["pool"] for p in pools] == ["dc", "res"]

    # An option and a PROXY_SHARD_* variable win over the project, and the line says so.
    env = _project_env(PROXY_SHARD_NAMESPACE="envns")
    over = run(env, "--pool", "res2", "add", "10.1.0.9:3128", cwd=project)
    assert over.returncode == 0, over.stderr
    assert "namespace 'envns' (PROXY_SHARD_NAMESPACE), pool for changes 'res2' (--pool)" in over.stderr
    assert PoolStore(real_redis, namespace="envns").pool_size("res2") == 1
    opt = run(env, "--namespace", "optns", "add", "10.1.0.9:3128", cwd=project)
    assert "namespace 'optns' (--namespace)" in opt.stderr and "pool for changes 'dc' (project)" in opt.stderr

    # A generic REDIS_URL in the environment (scrapy-redis's) does not beat the project's own setting...
    dead = f"redis://127.0.0.1:{free_port()}/0"
    generic = run(_project_env(REDIS_URL=dead), "pools", cwd=project)
    assert generic.returncode == 0 and f"Redis {redis_server.url} (project)" in generic.stderr
    # ...and a project with only scrapy-redis's REDIS_URL setting is read as the crawl reads it.
    only = _project(tmp_path / "sr", f'REDIS_URL = "{redis_server.url}"\nPROXY_SHARD_NAMESPACE = "projns"\n')
    sr = run(_project_env(), "pools", cwd=only)
    assert sr.returncode == 0 and f"Redis {redis_server.url} (project REDIS_URL)" in sr.stderr
    assert "pool for changes 'default' (default)" in sr.stderr

    # Outside a project nothing is said (and the defaults or the environment apply as before).
    outside = run(_project_env(PROXY_SHARD_REDIS_URL=redis_server.url, PROXY_SHARD_NAMESPACE="projns"), "pools",
                  cwd=tmp_path)
    assert outside.returncode == 0 and outside.stderr == ""


def test_a_bad_or_broken_project_setting_is_one_line(tmp_path, redis_server):
    bad = _project(tmp_path / "bad", 'PROXY_SHARD_REDIS_URL = "http://u:Pw-Bob-88@h:1"\n')
    proc = run(_project_env(), "pools", cwd=bad)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "Error: PROXY_SHARD_REDIS_URL in the Scrapy project's settings: 'http://***:***@h:1' must start with "
        "redis://, rediss:// or unix://"]
    bad_pool = _project(tmp_path / "badpool", 'PROXY_SHARD_POOL = "no pool!"\n')
    proc = run(_project_env(), "pools", cwd=bad_pool)
    assert proc.returncode == 2 and "PROXY_SHARD_POOL in the Scrapy project's settings" in proc.stderr
    # A settings module that does not import: a warning naming where (never quoting the line), then on.
    broken = _project(tmp_path / "broken", 'PROXY_SHARD_REDIS_URL = "redis://:Pw-Bob-88@h:1"\nraise_here(1)\n')
    proc = run(_project_env(PROXY_SHARD_REDIS_URL=redis_server.url, PROXY_SHARD_NAMESPACE=NS), "add", "10.1.0.2:1",
               cwd=broken)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "scrapy-proxy-shard: warning: cannot read the Scrapy project's settings (projx.settings: NameError at "
        "settings.py:3); using options, environment and defaults"]


def test_watch_refreshes_status(env, busy_pool):
    proc = run(env, "watch", "--interval", "0.1", "--iterations", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("pool 'default': 4 proxies") == 2


# --- errors and exit codes ----------------------------------------------------------------------------------

def test_redis_down_is_one_line_exit_1_without_credentials():
    env = {**os.environ, "PROXY_SHARD_REDIS_URL": f"redis://:Pw-Carol-99@127.0.0.1:{free_port()}/0",
           "PROXY_SHARD_NAMESPACE": NS}
    outputs = [(proc.returncode, proc.stdout, proc.stderr) for proc in (run(env, "status"),
                                                                        run(env, "load", "-", stdin=GOOD))]
    outputs += [(r.exit_code, r.stdout, r.stderr) for r in (invoke(env, "hosts"), invoke(env, "ban", "10.0.0.1:1"))]
    for code, out, err in outputs:
        assert code == 1, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: cannot reach Redis at redis://***:***@127.0.0.1:")
        assert out == ""


def test_usage_and_validation_errors_exit_2(env):
    assert run(env, "frobnicate").returncode == 2
    bad_pool = invoke(env, "--pool", "bad pool!", "status")
    assert bad_pool.exit_code == 2 and "invalid pool name" in bad_pool.stderr
    bad_url = invoke(env, "--redis-url", "http://u:Pw-Bob-88@h:1", "status")
    assert bad_url.exit_code == 2 and "'http://***:***@h:1' must start with redis://" in bad_url.stderr
    assert invoke(env, "load", "/nonexistent/proxies.txt").exit_code == 2
    assert invoke(env, "unban", "--all", "--site", "a.example", "x").exit_code == 2
    assert invoke(env, "ban", "not-a-url:").exit_code == 2


def test_load_of_a_non_utf8_file_is_one_line_naming_file_and_line(env, tmp_path, store):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"10.1.0.2:3128\n# caf\xe9 proxies\n10.1.0.3:3128\n")
    proc = run(env, "load", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"Error: {path}:2: not UTF-8 text (byte 0xe9): save the file as UTF-8"]
    assert store.pool_size("default") == 0


@pytest.mark.parametrize("site", ["", "  ", "*", "a b.com"])
def test_ban_with_an_empty_or_reserved_site_is_refused(env, store, site):
    store.add_proxies("default", ["10.1.0.2:3128"])
    for command in ("ban", "unban"):
        result = invoke(env, command, "10.1.0.2:3128", "--site", site)
        assert result.exit_code == 2 and "--site: invalid site" in result.stderr, result.stderr
    assert store.bans("default") == []


@pytest.mark.parametrize("ttl", ["nan", "inf", "-inf", "1e300", "0", "-5"])
def test_ban_ttl_must_be_finite_and_bounded_and_nothing_is_written(env, store, ttl):
    store.add_proxies("default", ["10.1.0.2:3128"])
    result = invoke(env, "ban", "10.1.0.2:3128", "--ttl", ttl)
    assert result.exit_code == 2 and "Invalid value for '--ttl'" in result.stderr, result.stderr
    assert store.bans("default") == [] and read_pool(store, "default").quarantines_started == 0
    assert invoke(env, "ban", "10.1.0.2:3128", "--ttl", "3600").exit_code == 0  # a sane one still works


def test_views_of_an_unknown_pool_or_empty_namespace_exit_1(env, store):
    empty = invoke(env, "status")
    assert empty.exit_code == 1 and "namespace 'clitest' has no pools yet" in empty.stderr
    store.add_proxies("default", ["10.1.0.2:3128"])
    unknown = invoke(env, "--pool", "nope", "status")
    assert unknown.exit_code == 1 and "pool 'nope' does not exist" in unknown.stderr and "default" in unknown.stderr


def test_metrics_command_serves_until_sigterm(env, store):
    store.add_proxies("default", ["10.1.0.2:3128"])
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "scrapy_proxy_shard", "metrics", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        body = _scrape_when_up(port)
        assert 'proxy_shard_proxies{pool="default"} 1.0' in body and "proxy_shard_up 1.0" in body
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert f"serving http://127.0.0.1:{port}/metrics" in err


def test_metrics_serves_up_0_while_redis_is_down_and_up_1_once_it_answers(tmp_path):
    server = RedisServer()  # its port is chosen, the server not started yet
    env = {**os.environ, "PROXY_SHARD_REDIS_URL": f"redis://127.0.0.1:{server.port}/0?password=Pw-Dave-11",
           "PROXY_SHARD_NAMESPACE": NS}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "scrapy_proxy_shard", "metrics", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        down = _scrape_when_up(port)
        assert "proxy_shard_up 0.0" in down and proc.poll() is None
        server.start()
        try:
            redis.Redis(port=server.port).config_set("requirepass", "Pw-Dave-11")
            PoolStore(redis.Redis.from_url(env["PROXY_SHARD_REDIS_URL"]), namespace=NS).add_proxies(
                "default", ["10.1.0.2:3128"])
            up = _scrape_until(port, "proxy_shard_up 1.0")
            assert 'proxy_shard_proxies{pool="default"} 1.0' in up
            server.stop()
            assert "proxy_shard_up 0.0" in _scrape_until(port, "proxy_shard_up 0.0")
        finally:
            server.stop()
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "Pw-Dave-11" not in err and "password=***" in err
    assert "Traceback" not in err and "Redis answers again" in err


def _scrape_until(port: int, text: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        body = _scrape_when_up(port)
        if text in body or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def _scrape_when_up(port: int, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return response.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_the_cli_drives_a_redis_cluster(redis_cluster, cluster_redis):
    env = {"PROXY_SHARD_REDIS_URL": f"redis://127.0.0.1:{redis_cluster.nodes[0].port}/0", "PROXY_SHARD_NAMESPACE": NS}
    for pool in ("dc", "res"):  # pools land on different shards
        assert invoke(env, "--cluster", "--pool", pool, "load", "-", stdin=GOOD).exit_code == 0
    store = PoolStore(cluster_redis, namespace=NS, host_id="host-a")
    store.heartbeat("res", ttl=60)
    held = store.lease("res", "shop.example", ttl=60)
    assert isinstance(held, Lease)
    pools = json.loads(invoke(env, "--cluster", "status", "--json").stdout)
    res = next(p for p in pools if p["pool"] == "res")
    assert res["sites"][0]["leased"] == 1 and res["live_hosts"] == 1
    assert "host-a" in invoke(env, "--cluster", "hosts").stdout


# --- migrate ------------------------------------------------------------------------------------------

def test_migrate_brings_a_pool_of_the_previous_layout_onto_the_current_one(env, store, real_redis):
    from scrapy_proxy_shard.engine import schema

    store.add_proxies("default", ["10.2.0.1:8080", "10.2.0.2:8080"])
    store.release(store.lease("default", "shop.example", ttl=5))
    p = store.prefix("default")
    # what the version before lazy sites wrote: P:sites, no add numbers, no site hashes, no layout
    real_redis.hset(f"{p}:{schema.LEGACY_SITES}", "shop.example", 1)
    real_redis.delete(f"{p}:{schema.ORDER}", f"{p}:{schema.SITEIDX}", f"{p}:{schema.SITE}:shop.example")
    real_redis.hdel(f"{p}:{schema.META}", schema.META_LAYOUT, "seq")
    result = invoke(env, "migrate")
    assert result.exit_code == 0 and "pool 'default': migrated" in result.stdout
    assert real_redis.hget(f"{p}:{schema.META}", schema.META_LAYOUT) == schema.LAYOUT
    assert real_redis.zcard(f"{p}:{schema.ORDER}") == 2 and not real_redis.exists(f"{p}:{schema.LEGACY_SITES}")
    assert store.sites("default") == {"shop.example": 1}
    assert "already on the current layout" in invoke(env, "migrate").stdout


def _layout2_pool(store, real_redis, pool: str, url: str) -> str:
    """A pool written before exits were the identity: the proxy's id hashed from its URL; returns it."""
    import hashlib

    from scrapy_proxy_shard.engine import schema
    from scrapy_proxy_shard.engine.proxies import make_proxy

    store.add_proxies(pool, [url])
    p = store.prefix(pool)
    new = make_proxy(url).id
    old = hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
    real_redis.hdel(f"{p}:{schema.PROXIES}", new)
    real_redis.zrem(f"{p}:{schema.ORDER}", new)
    real_redis.hset(f"{p}:{schema.PROXIES}", old, url)
    real_redis.zadd(f"{p}:{schema.ORDER}", {old: 1})
    real_redis.hset(f"{p}:{schema.META}", schema.META_LAYOUT, "2")
    return new


def test_migrate_rests_rekeyed_proxies_a_safe_warmup_or_the_one_given(env, store, real_redis):
    """A request through an old id may run as long as its lease (max(60, DOWNLOAD_TIMEOUT + 30) s): the
    re-keyed proxy must rest that long, not a fixed 60 s."""
    for bad in ("-1", "nan", "abc", "1e9"):
        result = invoke(env, "migrate", "--warmup", bad)
        assert result.exit_code == 2 and "--warmup" in result.stderr, result.stderr
        assert len([line for line in result.stderr.splitlines() if line.startswith("Error")]) == 1
    new = _layout2_pool(store, real_redis, "default", "http://10.2.1.1:8080")
    assert "pool 'default': migrated" in invoke(env, "--pool", "default", "migrate").stdout
    rest = [b for b in store.bans("default") if b.proxy_id == new]
    assert len(rest) == 1 and rest[0].scope == "*" and 590 <= rest[0].until - time.time() <= 600
    new = _layout2_pool(store, real_redis, "slow", "http://10.2.1.2:8080")
    assert "pool 'slow': migrated" in invoke(env, "--pool", "slow", "migrate", "--warmup", "1830").stdout
    rest = [b for b in store.bans("slow") if b.proxy_id == new]
    assert len(rest) == 1 and 1820 <= rest[0].until - time.time() <= 1830
