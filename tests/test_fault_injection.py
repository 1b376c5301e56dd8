"""Fault injection: three real `scrapy crawl` processes, real local proxies, the local anti-bot site and
a real redis-server, while Redis is FLUSHALLed, stalled past the clients' socket timeout, stopped and
restarted on the same port, and while the pool is drained and re-added under load.

Verdicts come from the site's own log (what an anti-bot system sees), never from crawler stats:
every catalog page served OK, zero requests from the host's own address (the demo resolver sends a
request that escapes the proxies to the site, from 127.0.0.1; proxies egress from 127.0.0.11+), zero
overlaps (two requests in flight at once from one IP on one site). Plus one ledger check between
Redis and the hosts, defined in :class:`Fault.lease_check`.

Each fault is one crawl, triggered once the site has served ``TRIGGER`` pages and every host has
leased, so a failure names its fault. A compact summary per fault is printed (``-s``) and is the assertion message.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import redis

from scrapy_proxy_shard.demo.redis_server import RedisServer
from scrapy_proxy_shard.demo.run import NAMESPACE, DemoConfig, DemoResult, run_demo
from scrapy_proxy_shard.engine import schema
from scrapy_proxy_shard.engine.store import PoolStore

pytestmark = pytest.mark.slow

POOLS = ("datacenter", "residential")
HOSTS = 3
SITES = ("shop-a.test", "shop-b.test", "market.test")
PAGES = 80  # per site: 240 catalog pages over 3 hosts
#: 4 residential + 16 datacenter (one dead, one slow). With 8 datacenter proxies, one host in ~25 runs
#: had an empty fallback slice (rendezvous hashing of ephemeral proxy ports) and failed its whole
#: shard with "holds no proxies" during a stall; 16 make that ~1 in 200 (it is a finding, reported).
PROXIES = 20
TRIGGER = 60  # pages the site has served when the fault is injected
SOCKET_TIMEOUT = 1.5
STALL = 3.5  # DEBUG SLEEP: past the first timeout and the retry's (2 x SOCKET_TIMEOUT)
RESTART_GAP = 1.0  # seconds the redis-server is down (the hosts' first probe comes 0.5 s after they notice)
DRAIN_CYCLES = 20  # one per runner poll (0.25 s): half the datacenter pool removed and re-added at once
SETTINGS = {
    "PROXY_SHARD_REDIS_PARAMS": f'{{"socket_connect_timeout": 1, "socket_timeout": {SOCKET_TIMEOUT}}}',
    "PROXY_SHARD_FALLBACK_GRACE": "1",
    "PROXY_SHARD_FALLBACK_WARMUP": "1",
    "PROXY_SHARD_SNAPSHOT_INTERVAL": "0.5",
    # A ghost lease (a script that ran but whose caller gave up) holds its slot for the TTL: keep it
    # short so a ghost costs seconds, not the run; the ledger check still counts every ghost.
    "PROXY_SHARD_LEASE_TTL": "8",
    "DOWNLOAD_TIMEOUT": "5",
}


#: The leases counted in every site's counters (P:sitestats:<site>, field "l"), summed in one script so
#: the read is atomic with what follows it in a transaction (a FLUSHALL, a CLIENT PAUSE). KEYS in a
#: script: a test server of a few dozen keys, never the plugin's own way.
_SUM_SITE_LEASES = """
local total = 0
for _, key in ipairs(redis.call('KEYS', ARGV[1])) do
  total = total + tonumber(redis.call('HGET', key, 'l') or '0')
end
return total
"""


def _site_lease_total(client: redis.Redis) -> int:
    """Leases lease.lua granted since Redis was last emptied: the ``l`` field of every pool's per-site
    counters. (Per-host counters would not do: a host that closes cleanly deletes its own in
    host_leave.lua. Adoptions by hold.lua do not count here: they are fallback leases on both sides.)"""
    return int(_sstats_reads(client))


def _sstats_reads(pipe):
    """Queue (or, on a client, run) the sum of the site lease counters of the namespace."""
    return pipe.eval(_SUM_SITE_LEASES, 0, f"{{{NAMESPACE}:*}}:{schema.SITESTATS}:*")


def _client(server: RedisServer, timeout: float = 10.0) -> redis.Redis:
    return redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=timeout)


@dataclass
class Fault:
    """Injects one fault once the site has served ``TRIGGER`` pages, and keeps Redis's lease ledger.

    Redis's side of the ledger is counted per *epoch*: an epoch ends when Redis loses its data
    (FLUSHALL, a restart without persistence). Its total is read atomically with the reset (inside
    the MULTI that flushes, or right before CLIENT PAUSE freezes every client ahead of the kill), so
    no lease is lost between the read and the reset; the last epoch is read after every host exited.
    """

    name: str
    #: Pages the site has served when the fault is injected.
    trigger: int = TRIGGER
    injected_at: float | None = None
    closed_epochs: list[int] = field(default_factory=list)
    final_epoch: int = 0
    notes: list[str] = field(default_factory=list)
    #: Hosts seen holding a lease count in Redis so far (a host that finished cleanly deletes its
    #: counters when it leaves, so the set is kept across ticks).
    started_hosts: set[str] = field(default_factory=set)

    # --- the run's Injector interface ------------------------------------------------------------
    def tick(self, server: RedisServer, elapsed: float, served: int) -> None:
        if self.injected_at is None and self._every_host_leased(server) and served >= self.trigger:
            self.injected_at = elapsed
            self.inject(server)
        elif self.injected_at is not None:
            self.after(server)

    def finish(self, server: RedisServer) -> None:
        client = _client(server)
        try:
            self.final_epoch = _site_lease_total(client)
        finally:
            client.close()

    def _every_host_leased(self, server: RedisServer) -> bool:
        """Every host has taken a lease from Redis, so it has started: a host slow to start (a loaded
        CI machine) would otherwise meet the fault at its start and stop there by design ("cannot
        start: cannot reach Redis"), which is not what these tests are about."""
        if len(self.started_hosts) >= HOSTS:
            return True
        client = _client(server)
        try:
            self.started_hosts |= {name.rsplit(":", 1)[0] for pool in POOLS
                                   for name, count in client.hgetall(f"{{{NAMESPACE}:{pool}}}:hstats").items()
                                   if name.endswith(":l") and int(count) > 0}
        finally:
            client.close()
        return len(self.started_hosts) >= HOSTS

    # --- what each fault does ----------------------------------------------------------------------
    def inject(self, server: RedisServer) -> None:
        raise NotImplementedError

    def after(self, server: RedisServer) -> None:
        """Called on every later poll (a fault that goes on for a while)."""

    # --- the ledger --------------------------------------------------------------------------------
    @property
    def redis_leases(self) -> int:
        return sum(self.closed_epochs) + self.final_epoch

    def lease_check(self, result: DemoResult) -> tuple[bool, str]:
        """Redis's lease count against the hosts' count of leases they took from Redis: equal, exactly.

        hosts = sum over hosts of ``proxy_shard/leases`` (every lease handed to a request) minus the
        fallback leases handed to requests: ``proxy_shard/fallback/leases`` (every lease the local
        engine issued) less ``proxy_shard/fallback/leases_returned`` (grace-period leases Redis
        refused to adopt, given back unused), plus the lease calls whose reply was lost and that Redis
        had run (``proxy_shard/leases/abandoned/released`` and ``/gone``: the host settles each one
        with ``abandon.lua`` at its next call). A lease script that ran in Redis while its caller gave
        up and that nobody settles shows as redis > hosts: a ghost, holding its slot for nobody until
        the TTL.
        """
        leases = sum(h.stats.get("proxy_shard/leases", 0) for h in result.hosts)
        fallback = sum(h.stats.get("proxy_shard/fallback/leases", 0) for h in result.hosts)
        returned = sum(h.stats.get("proxy_shard/fallback/leases_returned", 0) for h in result.hosts)
        settled = sum(h.stats.get(f"proxy_shard/leases/abandoned/{status}", 0)
                      for h in result.hosts for status in ("released", "gone"))
        hosts = leases - (fallback - returned) + settled
        epochs = "+".join(str(n) for n in [*self.closed_epochs, self.final_epoch])
        missing_stats = [h.name for h in result.hosts if not h.stats]
        detail = (f"redis {self.redis_leases} (epochs {epochs}) vs hosts {hosts} "
                  f"(leases {leases} - fallback {fallback} + returned {returned} + settled {settled})")
        if missing_stats:
            detail += f"; no stats from {', '.join(missing_stats)} (did not finish)"
        return self.redis_leases == hosts and not missing_stats, detail


class FlushAll(Fault):
    """FLUSHALL mid-crawl (an emptied Redis the clients stay connected to)."""

    def inject(self, server: RedisServer) -> None:
        client = _client(server)
        try:
            pipe = client.pipeline(transaction=True)
            _sstats_reads(pipe)
            pipe.flushall()
            replies = pipe.execute()
        finally:
            client.close()
        self.closed_epochs.append(int(replies[0]))


class Stall(Fault):
    """DEBUG SLEEP past the clients' socket timeout (and past the retry that timeout triggers)."""

    def inject(self, server: RedisServer) -> None:
        client = _client(server, timeout=STALL + 10)
        try:
            started = time.monotonic()
            client.execute_command("DEBUG", "SLEEP", STALL)
            self.notes.append(f"stalled {time.monotonic() - started:.1f}s")
        finally:
            client.close()


@dataclass
class Restart(Fault):
    """Stop the redis-server mid-crawl and start it again, empty, on the same port. Early enough that
    the hosts go back to the restarted Redis (past their fallback grace) before the crawl ends."""

    trigger: int = 30

    def inject(self, server: RedisServer) -> None:
        client = _client(server)
        try:
            pipe = client.pipeline(transaction=True)
            _sstats_reads(pipe)
            pipe.execute_command("CLIENT", "PAUSE", 60000, "ALL")  # nothing runs after the read
            replies = pipe.execute()
        finally:
            client.close()
        self.closed_epochs.append(int(replies[0]))
        time.sleep(0.3)  # replies of scripts that ran before the pause reach their callers
        server.kill()
        time.sleep(RESTART_GAP)
        server.start()


@dataclass
class DrainReadd(Fault):
    """Remove half the datacenter pool and add it back at once (store API, as `remove` then `load`
    would), alternating halves, ``DRAIN_CYCLES`` times: every proxy is drained and re-added while
    requests hold its slots. The pool is never empty (that would be another fault: see FlushAll)."""

    cycles: int = 0
    proxies: list = field(default_factory=list)

    def inject(self, server: RedisServer) -> None:
        store = self._store(server)
        try:
            self.proxies = [record.proxy for record in store.list_proxies("datacenter")]
        finally:
            store.client.close()
        self.after(server)

    def after(self, server: RedisServer) -> None:
        if self.cycles >= DRAIN_CYCLES:
            return
        half = self.proxies[self.cycles % 2::2]
        store = self._store(server)
        try:
            removed = store.remove_proxies("datacenter", [p.id for p in half])
            store.add_proxies("datacenter", half)
        finally:
            store.client.close()
        self.cycles += 1
        if removed != len(half):
            self.notes.append(f"cycle {self.cycles}: removed {removed} of {len(half)}")

    @staticmethod
    def _store(server: RedisServer) -> PoolStore:
        return PoolStore(_client(server), namespace=NAMESPACE, host_id="fault-injector")


def _crawl(fault: Fault | None, tmp_path, **overrides) -> DemoResult:
    config = DemoConfig(hosts=HOSTS, pages=PAGES, proxies=PROXIES, flows=0, sites=SITES, burnt={}, workdir=tmp_path,
                        progress=False, timeout=40, direct_reachable=True, injector=fault,
                        settings=dict(SETTINGS))
    for name, value in overrides.items():
        setattr(config, name, value)
    return run_demo(config)


def _verdicts(fault: Fault, result: DemoResult) -> list[tuple[str, bool, str]]:
    s = result.summary
    expected = len(result.config.expected_pages)
    leases_ok, leases = fault.lease_check(result)
    examples = "".join(f"; {o}" for o in s.overlap_examples[:3])
    direct = "".join(f"; {e['ip']} {e['site']}{e['path']} -> {e['status']}" for e in result.direct_requests[:3])
    missing = f", missing e.g. {', '.join(site + path for site, path in s.missing_pages[:3])}" \
        if s.missing_pages else ""
    return [
        ("every page fetched", not s.missing_pages, f"{s.ok_pages}/{expected} pages{missing}"),
        ("zero direct requests", not result.direct_requests, f"{len(result.direct_requests)} direct{direct}"),
        ("zero overlaps", s.overlaps == 0, f"{s.overlaps} overlaps{examples}"),
        ("Redis's lease count == the hosts'", leases_ok, leases),
    ]


def _host_errors(result: DemoResult, top: int = 2) -> list[str]:
    """The commonest ERROR lines of each host's log, URLs folded, with counts: the why of a failure."""
    lines = []
    for host in result.hosts:
        text = host.log_path.read_text(errors="replace") if host.log_path.exists() else ""
        errors = Counter(re.sub(r"https?://\S+", "<url>", line.split("ERROR: ", 1)[1])[:160]
                         for line in text.splitlines() if "ERROR: " in line)
        lines += [f"  {host.name} ERROR x{n}: {message}" for message, n in errors.most_common(top)]
    return lines


def _report(fault: Fault, result: DemoResult, verdicts: list[tuple[str, bool, str]]) -> str:
    exits = ", ".join(f"{h.name} exit {h.exit_code}" for h in result.hosts)
    head = (f"[{fault.name}] injected at {fault.injected_at:.1f}s ({fault.trigger} pages served)"
            if fault.injected_at is not None else f"[{fault.name}] NOT injected")
    lines = [f"{head}; {exits}; {result.duration:.1f}s; workdir {result.workdir}", *fault.notes]
    lines += [f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}" for name, ok, detail in verdicts]
    return "\n".join(lines + _host_errors(result))


FAULTS = {"flushall": FlushAll, "stall": Stall, "restart": Restart, "drain_readd": DrainReadd}


@pytest.mark.parametrize("name", list(FAULTS))
def test_three_crawls_survive_the_fault_without_direct_requests_overlaps_or_ghost_leases(name, tmp_path):
    fault = FAULTS[name](name)
    result = _crawl(fault, tmp_path)
    verdicts = _verdicts(fault, result)
    report = _report(fault, result, verdicts)
    print("\n" + report)
    assert fault.injected_at is not None, report
    if isinstance(fault, Restart):  # else the ledger never saw the restarted Redis: a weaker test
        assert fault.final_epoch > 0, f"the crawl ended before any host leased from the restarted Redis\n{report}"
    failed = [f"{check}: {detail}" for check, ok, detail in verdicts if not ok]
    assert not failed, report


def test_the_site_log_shows_a_request_that_bypasses_the_proxies(tmp_path):
    """The direct-request check can fail: with the plugin switched off (no add-on), every request of
    a real crawl reaches the site from the host's own address, and the site's log says so."""
    result = _crawl(None, tmp_path, hosts=1, pages=1, sites=SITES[:1], settings={**SETTINGS, "ADDONS": "{}"},
                    redis_args=())
    assert result.summary.ok_pages == 1, result.format()  # one page: a second would break the site's rules
    assert [e["ip"] for e in result.direct_requests] == ["127.0.0.1"], result.format()
    assert result.summary.requests == 1, result.format()
    assert ("zero requests from the host's own address", False) in [(n, ok) for n, ok, _ in result.checks()]
