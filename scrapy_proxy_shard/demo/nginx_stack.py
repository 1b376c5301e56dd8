"""A rate-limited site made of stock software nobody here wrote: Debian's nginx and tinyproxy.

The project's own anti-bot site (``demo/site.py``) judges the plugin by rules this project wrote; this
stack judges it by the rules real sites run. :class:`NginxStack` starts, on free loopback ports and
without any root-owned path (its own directory for config, certificate, pid files and logs):

* one **nginx** (``nginx -p DIR -c nginx.conf -e error.log -g 'daemon off;'``) serving a small generated
  static catalog (``/index.html`` linking ``/item/N.html``, each item linking back and to the next) on
  ``vhosts`` virtual hosts, each over HTTP and HTTPS (a self-signed certificate made at start with
  ``cryptography``, which Scrapy already depends on). Each virtual host is an IP-literal loopback
  address, ``127.0.2.N``: a host *name* would have to be resolved by tinyproxy through the system
  resolver (``/etc/hosts``, root-owned), and TLS clients send no SNI for IP literals, so one listen
  address per vhost is what routes HTTPS to the right ``server`` block. ``$host`` is that address.
  Per (client IP, vhost), ``limit_req`` answers **429** beyond ``1 / interval`` requests per second
  and ``limit_conn`` answers **503** to a second request in flight. The limit is ``burst=1 nodelay``
  by default: nginx's leaky bucket then tolerates one arrival early by path jitter (tens of ms between
  a lease in Redis and the request reaching nginx) but no sustained rate above the rule; ``burst=0``
  rejects any arrival less than ``interval`` after the last accepted one, which a client pacing at
  exactly the rule cannot meet through a jittery path. The access log is JSON lines
  (``log_format ... escape=json``) with ``$remote_addr``, ``$host``, ``$status``, ``$msec`` (the time
  the response was logged), ``$request_time`` (since the first request byte) and ``$request``.
* one stock **tinyproxy** per proxy (``tinyproxy -d -c conf``), listening on ``127.0.0.1:<own port>``
  and sending from its own source address (``Bind 127.0.0.<10+n>``), so nginx's ``$remote_addr``
  tells proxies apart; ``ConnectPort`` allows CONNECT tunnels to the HTTPS port only.

:func:`analyze_access_log` turns nginx's log into the verdicts: pages served, 429/503 counts, overlaps
(two requests of one (IP, vhost) in flight at once, a request's start being ``$msec - $request_time``)
and interval violations (two arrivals of one (IP, vhost) closer than the interval), requests from
addresses that are not a proxy's (sent unproxied). Used by ``tests/test_nginx_stack.py`` and
``benchmarks/bench_nginx.py``.
"""

from __future__ import annotations

import datetime
import grp
import ipaddress
import itertools
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from scrapy_proxy_shard.demo.redis_server import terminate
from scrapy_proxy_shard.demo.run import default_project

#: The Debian packages the stack runs on (``apt-get install nginx libnginx-mod-http-echo tinyproxy``).
APT_PACKAGES = ("nginx", "libnginx-mod-http-echo", "tinyproxy")
VHOST_NET = "127.0.2."
PROXY_NET = "127.0.0."
PROXY_FIRST = 11
#: Two requests of one (IP, vhost) whose times differ by less than this are not called an overlap:
#: ``$msec`` and ``$request_time`` are both rounded to the millisecond.
OVERLAP_TOLERANCE = 0.002
#: Debian's echo module (package libnginx-mod-http-echo): ``echo_sleep`` gives a static page the
#: service time of a real one, on nginx's own millisecond timers. (``limit_rate`` cannot: it counts
#: in whole seconds and lets the first second's worth of bytes go at once.)
ECHO_MODULE = "/usr/lib/nginx/modules/ngx_http_echo_module.so"


class StackUnavailable(RuntimeError):
    """nginx or tinyproxy is not installed (the message names the package to install)."""


def find_binary(name: str) -> str | None:
    """``name`` on PATH, or in /usr/sbin and /sbin (nginx lives there and a non-root PATH may lack it)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def missing_binaries(latency: bool = True) -> list[str]:
    """What the stack needs and is not installed, each with the Debian package that has it
    (the echo module only when pages are served with a latency)."""
    missing = [f"{name} (package {name})" for name in ("nginx", "tinyproxy") if not find_binary(name)]
    if latency and not Path(ECHO_MODULE).exists():
        missing.append(f"{ECHO_MODULE} (package libnginx-mod-http-echo)")
    return missing


def binary_versions() -> dict[str, str]:
    """``{"nginx": "1.22.1", "tinyproxy": "1.11.1"}`` for the installed binaries."""
    versions = {}
    for name, flag in (("nginx", "-v"), ("tinyproxy", "-v")):
        path = find_binary(name)
        if path:
            out = subprocess.run([path, flag], capture_output=True, text=True, timeout=10)
            text = (out.stdout + out.stderr).strip()
            versions[name] = text.rsplit("/", 1)[-1].rsplit(" ", 1)[-1]
    return versions


def nginx_rate(interval: float) -> str:
    """nginx's ``rate=`` for one request per ``interval`` seconds: nginx takes integers per second or per
    minute only, so an interval whose rate is neither is refused rather than rounded."""
    for unit, seconds in (("r/s", 1.0), ("r/m", 60.0)):
        rate = seconds / interval
        if abs(rate - round(rate)) < 1e-9 and round(rate) >= 1:
            return f"{round(rate)}{unit}"
    raise ValueError(f"interval {interval}s is not 1/N s or 60/N s: nginx's limit_req cannot express it")


@dataclass
class ProxyProcess:
    port: int
    source_ip: str
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class NginxStack:
    """nginx + one tinyproxy per proxy; ``start()``/``stop()`` or a context manager."""

    vhosts: int = 3
    proxies: int = 6
    pages: int = 20
    #: The site's rule: one request per (IP, vhost) per ``interval`` seconds.
    interval: float = 0.2
    burst: int = 1
    #: Requests in flight per (IP, vhost) before nginx answers 503.
    conn_limit: int = 1
    #: Seconds nginx waits before serving an item page (``echo_sleep``, see ``ECHO_MODULE``); 0 needs
    #: no module. Indexes are served at once.
    latency: float = 0.05
    workdir: Path | None = None
    http_port: int = 0
    https_port: int = 0
    proxy_list: list[ProxyProcess] = field(default_factory=list)
    nginx: subprocess.Popen | None = None
    _tmp: tempfile.TemporaryDirectory | None = None

    # --- addresses ---------------------------------------------------------------------------------

    @property
    def vhost_ips(self) -> list[str]:
        return [f"{VHOST_NET}{n}" for n in range(1, self.vhosts + 1)]

    @property
    def proxy_ips(self) -> list[str]:
        return [f"{PROXY_NET}{PROXY_FIRST + n}" for n in range(self.proxies)]

    @property
    def proxy_urls(self) -> list[str]:
        return [p.url for p in self.proxy_list]

    @property
    def access_log(self) -> Path:
        return self.dir / "logs" / "access.log"

    @property
    def dir(self) -> Path:
        if self.workdir is None:
            raise RuntimeError("the stack is not started")
        return self.workdir

    def base_url(self, vhost: str, scheme: str) -> str:
        return f"{scheme}://{vhost}:{self.http_port if scheme == 'http' else self.https_port}"

    def item_scheme(self, n: int) -> str:
        """Odd items are linked over HTTP, even ones over HTTPS: every crawl uses both."""
        return "http" if n % 2 else "https"

    def index_urls(self) -> list[str]:
        """Each vhost's index, the first over HTTPS, the next over HTTP, and so on."""
        return [f"{self.base_url(v, 'https' if i % 2 == 0 else 'http')}/index.html"
                for i, v in enumerate(self.vhost_ips)]

    def item_urls(self) -> list[str]:
        return [f"{self.base_url(v, self.item_scheme(n))}/item/{n}.html"
                for v in self.vhost_ips for n in range(1, self.pages + 1)]

    @property
    def expected_pages(self) -> set[tuple[str, str]]:
        """(vhost, path) of every page a full crawl fetches: the indexes and every item."""
        return ({(v, "/index.html") for v in self.vhost_ips}
                | {(v, f"/item/{n}.html") for v in self.vhost_ips for n in range(1, self.pages + 1)})

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> NginxStack:
        missing = missing_binaries(latency=bool(self.latency))
        if missing:
            raise StackUnavailable("not installed: " + ", ".join(missing) + "; run: apt-get install "
                                   + " ".join(APT_PACKAGES))
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="proxy-shard-nginx-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for attempt in range(3):  # a port taken between choosing it and nginx binding it: choose again
                self.http_port, self.https_port = _free_port(self.vhost_ips[0]), _free_port(self.vhost_ips[0])
                self._write_site()
                try:
                    self._start_nginx(timeout)
                    break
                except _PortTaken:
                    if attempt == 2:
                        raise
            for n, ip in enumerate(self.proxy_ips):
                self.proxy_list.append(self._start_tinyproxy(n, ip, timeout))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process by PID (SIGTERM, then SIGKILL); the directory stays if it was given."""
        for proxy in self.proxy_list:
            terminate(proxy.process)
            proxy.process = None
        proc, self.nginx = self.nginx, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(15)  # nginx's fast shutdown; its workers exit with the master
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NginxStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def read_log(self) -> list[dict]:
        return read_access_log(self.access_log)

    def analyze(self, since: float = 0.0, **kwargs) -> LogSummary:
        """:func:`analyze_access_log` over the requests that ended at or after ``since`` (epoch seconds;
        a benchmark runs several crawls on one stack)."""
        kwargs.setdefault("interval", self.interval)
        kwargs.setdefault("proxy_ips", self.proxy_ips)
        kwargs.setdefault("expected_pages", self.expected_pages)
        return analyze_access_log([e for e in self.read_log() if e["end"] >= since], **kwargs)

    # --- files -------------------------------------------------------------------------------------

    def _write_site(self) -> None:
        d = self.dir
        for sub in ("logs", "tmp", "conf"):
            (d / sub).mkdir(exist_ok=True)
        for vhost in self.vhost_ips:
            root = d / "www" / vhost
            (root / "item").mkdir(parents=True, exist_ok=True)
            links = "\n".join(f'<li><a class="item" href="{self.base_url(vhost, self.item_scheme(n))}/item/{n}.html">'
                              f"item {n}</a></li>" for n in range(1, self.pages + 1))
            (root / "index.html").write_text(
                f"<!doctype html><html><head><title>{vhost} catalog</title></head><body>"
                f'<h1 class="title">Catalog of {vhost}</h1><ul class="catalog">\n{links}\n</ul></body></html>\n')
            for n in range(1, self.pages + 1):
                nxt = (f'<a class="next" href="/item/{n + 1}.html">next</a>' if n < self.pages else "")
                (root / "item" / f"{n}.html").write_text(
                    f"<!doctype html><html><head><title>item {n}</title></head><body>"
                    f'<div class="product"><h1 class="title">{vhost} item {n}</h1>'
                    f'<span class="price">{(n * 37) % 100 + 0.99:.2f}</span></div>'
                    f'<a class="index" href="/index.html">catalog</a> {nxt}</body></html>\n')
        _write_certificate(d / "conf" / "cert.pem", d / "conf" / "key.pem", self.vhost_ips)
        (d / "conf" / "nginx.conf").write_text(self._nginx_conf())

    def _nginx_conf(self) -> str:
        d = self.dir
        user = ""
        if os.geteuid() == 0:  # workers would run as nobody and could not read a private temp dir
            user = f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};\n"
        burst = f" burst={self.burst} nodelay" if self.burst else ""
        item = ""
        if self.latency:  # limit_req and limit_conn count a request once, before its internal redirect
            user = f"load_module {ECHO_MODULE};\n{user}"
            item = f"""
        location /item/ {{
            echo_sleep {self.latency:.3f};
            echo_exec @static;
        }}
        location @static {{ }}"""
        servers = []
        for vhost in self.vhost_ips:
            servers.append(f"""
    server {{
        listen {vhost}:{self.http_port};
        listen {vhost}:{self.https_port} ssl;
        server_name {vhost};
        ssl_certificate {d}/conf/cert.pem;
        ssl_certificate_key {d}/conf/key.pem;
        root {d}/www/{vhost};
        limit_req zone=per_ip_vhost{burst};
        limit_conn conn_ip_vhost {self.conn_limit};
        location / {{ }}{item}
    }}""")
        return f"""{user}worker_processes 1;
pid {d}/logs/nginx.pid;
error_log {d}/logs/error.log warn;
events {{ worker_connections 1024; }}
http {{
    default_type text/html;
    types {{ text/html html; }}
    sendfile on;
    keepalive_timeout 30s;
    keepalive_requests 10000;
    client_body_temp_path {d}/tmp/body;
    proxy_temp_path {d}/tmp/proxy;
    fastcgi_temp_path {d}/tmp/fastcgi;
    uwsgi_temp_path {d}/tmp/uwsgi;
    scgi_temp_path {d}/tmp/scgi;
    # Per client IP and virtual host: the key anti-bot rules count by.
    limit_req_zone $binary_remote_addr$host zone=per_ip_vhost:4m rate={nginx_rate(self.interval)};
    limit_req_status 429;
    limit_conn_zone $binary_remote_addr$host zone=conn_ip_vhost:4m;
    limit_conn_status 503;
    log_format shard escape=json '{{"remote_addr":"$remote_addr","host":"$host","status":$status,'
        '"msec":$msec,"request_time":$request_time,"request":"$request","scheme":"$scheme",'
        '"connection":$connection,"connection_requests":$connection_requests,"bytes":$body_bytes_sent}}';
    access_log {d}/logs/access.log shard;
{"".join(servers)}
}}
"""

    def _start_nginx(self, timeout: float) -> None:
        d = self.dir
        (d / "logs" / "error.log").touch()
        cmd = [find_binary("nginx") or "nginx", "-p", str(d), "-c", str(d / "conf" / "nginx.conf"),
               "-e", str(d / "logs" / "error.log"), "-g", "daemon off;"]
        with open(d / "logs" / "nginx.out", "ab") as out:
            self.nginx = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
        addresses = [(v, port) for v in self.vhost_ips for port in (self.http_port, self.https_port)]
        deadline = time.monotonic() + timeout
        while True:
            if self.nginx.poll() is not None:
                err = (d / "logs" / "error.log").read_text(errors="replace")
                err += (d / "logs" / "nginx.out").read_text(errors="replace")
                self.nginx = None
                if "Address already in use" in err:
                    raise _PortTaken(err)
                raise RuntimeError(f"nginx exited at start: {err.strip()[-2000:]}")
            if all(_accepts(a) for a in addresses):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not listen on {addresses} within {timeout}s")
            time.sleep(0.02)

    def _start_tinyproxy(self, n: int, source_ip: str, timeout: float) -> ProxyProcess:
        d = self.dir
        last_error = ""
        for _ in range(3):
            port = _free_port("127.0.0.1")
            conf = d / "conf" / f"tinyproxy-{n}.conf"
            log = d / "logs" / f"tinyproxy-{n}.log"
            conf.write_text(f"""Port {port}
Listen 127.0.0.1
Bind {source_ip}
Timeout 30
MaxClients 200
Allow 127.0.0.1
ConnectPort {self.https_port}
DisableViaHeader Yes
XTinyproxy No
LogFile "{log}"
LogLevel Warning
PidFile "{d}/logs/tinyproxy-{n}.pid"
""")
            with open(d / "logs" / f"tinyproxy-{n}.out", "ab") as out:
                proc = subprocess.Popen([find_binary("tinyproxy") or "tinyproxy", "-d", "-c", str(conf)],
                                        stdout=out, stderr=out, start_new_session=True)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and not _accepts(("127.0.0.1", port)) and time.monotonic() < deadline:
                time.sleep(0.02)
            if proc.poll() is None and _accepts(("127.0.0.1", port)):
                return ProxyProcess(port, source_ip, proc)
            terminate(proc)
            last_error = (log.read_text(errors="replace") if log.exists() else "") + \
                (d / "logs" / f"tinyproxy-{n}.out").read_text(errors="replace")
        raise RuntimeError(f"tinyproxy {n} did not start: {last_error.strip()[-2000:]}")


class _PortTaken(RuntimeError):
    pass


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _accepts(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=0.2):
            return True
    except OSError:
        return False


def _write_certificate(cert_path: Path, key_path: Path, ips: list[str]) -> None:
    """A self-signed certificate for the vhost addresses (clients here do not verify it; it makes the
    TLS handshake real)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "scrapy-proxy-shard test stack")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


# --- the verdicts, from nginx's own log -----------------------------------------------------------------

def read_access_log(path: Path) -> list[dict]:
    """nginx's JSON-lines access log as dicts with ``start``/``end`` (epoch seconds) and ``path`` added.
    A line still being written (no newline yet) is left out."""
    entries = []
    if not Path(path).exists():
        return entries
    text = Path(path).read_text(errors="replace")
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n") or not line.strip():
            continue
        entry = json.loads(line)
        entry["end"] = float(entry["msec"])
        entry["start"] = entry["end"] - float(entry["request_time"])
        parts = entry["request"].split(" ")
        entry["path"] = parts[1] if len(parts) > 1 else ""
        entries.append(entry)
    return entries


@dataclass
class LogSummary:
    """What nginx saw. ``violations`` count arrivals of one (IP, vhost) closer than
    ``interval - tolerance`` to the previous arrival; ``overlaps`` count requests that started while
    another request of the same (IP, vhost) was still being served."""

    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    ok_pages: int = 0
    missing_pages: list[tuple[str, str]] = field(default_factory=list)
    overlaps: int = 0
    overlap_examples: list[str] = field(default_factory=list)
    violations: int = 0
    violation_examples: list[str] = field(default_factory=list)
    min_gap: float | None = None
    pairs: int = 0
    #: Requests from an address that is no proxy's source address (e.g. 127.0.0.1: sent unproxied).
    unproxied: list[dict] = field(default_factory=list)
    by_ip: Counter = field(default_factory=Counter)
    by_scheme: Counter = field(default_factory=Counter)
    first_start: float = 0.0
    last_end: float = 0.0
    mean_request_time: float = 0.0
    interval: float = 0.0

    @property
    def rate_limited(self) -> int:
        return self.statuses.get(429, 0)

    @property
    def conn_limited(self) -> int:
        return self.statuses.get(503, 0)

    @property
    def blocked(self) -> int:
        return self.rate_limited + self.conn_limited

    @property
    def blocked_share(self) -> float:
        return self.blocked / self.requests if self.requests else 0.0

    @property
    def duration(self) -> float:
        return max(self.last_end - self.first_start, 0.0)

    @property
    def pages_per_second(self) -> float:
        return self.statuses.get(200, 0) / self.duration if self.duration else 0.0

    def format(self) -> str:
        gap = "n/a" if self.min_gap is None else f"{self.min_gap * 1000:.0f} ms"
        lines = [
            f"  requests {self.requests} in {self.duration:.2f}s ({self.pages_per_second:.1f} pages/s), "
            f"statuses {dict(sorted(self.statuses.items()))}, schemes {dict(self.by_scheme)}",
            f"  429 (limit_req) {self.rate_limited}, 503 (limit_conn) {self.conn_limited}, "
            f"blocked {self.blocked_share:.2%}",
            f"  overlaps per (IP, vhost) {self.overlaps}, interval violations {self.violations} of {self.pairs} "
            f"gaps (interval {self.interval * 1000:.0f} ms, shortest gap {gap})",
            f"  pages ok {self.ok_pages}, missing {len(self.missing_pages)}, unproxied requests "
            f"{len(self.unproxied)}, requests per source IP {dict(sorted(self.by_ip.items()))}",
        ]
        lines += [f"    overlap: {e}" for e in self.overlap_examples[:5]]
        lines += [f"    violation: {e}" for e in self.violation_examples[:5]]
        lines += [f"    missing: {h}{p}" for h, p in self.missing_pages[:5]]
        lines += [f"    unproxied: {e['remote_addr']} {e['host']} {e['request']}" for e in self.unproxied[:5]]
        return "\n".join(lines)


def analyze_access_log(entries: list[dict], *, interval: float, proxy_ips: list[str] | None = None,
                       expected_pages: set[tuple[str, str]] | None = None,
                       tolerance: float = 0.010) -> LogSummary:
    """The verdicts from nginx's access log (entries from :func:`read_access_log`).

    Per (``$remote_addr``, ``$host``), requests are ordered by start (``$msec - $request_time``): one that
    starts before an earlier one ended (by more than the log's millisecond rounding) is an overlap; one
    that starts less than ``interval - tolerance`` after the previous start is an interval violation
    (the tolerance is nginx's own timer granularity, not path jitter). Every arrival counts, served or
    refused: the site saw it. ``proxy_ips``: the proxies' source addresses; a request from any other
    address went around them.
    """
    s = LogSummary(requests=len(entries), interval=interval)
    if not entries:
        s.missing_pages = sorted(expected_pages or ())
        return s
    allowed = set(proxy_ips) if proxy_ips is not None else None
    by_pair: dict[tuple[str, str], list[dict]] = defaultdict(list)
    ok = set()
    for e in entries:
        s.statuses[int(e["status"])] += 1
        s.by_ip[e["remote_addr"]] += 1
        s.by_scheme[e.get("scheme", "?")] += 1
        by_pair[(e["remote_addr"], e["host"])].append(e)
        if int(e["status"]) == 200:
            ok.add((e["host"], e["path"]))
        if allowed is not None and e["remote_addr"] not in allowed:
            s.unproxied.append(e)
    s.ok_pages = len(ok)
    s.missing_pages = sorted((expected_pages or set()) - ok)
    s.first_start = min(e["start"] for e in entries)
    s.last_end = max(e["end"] for e in entries)
    s.mean_request_time = sum(float(e["request_time"]) for e in entries) / len(entries)
    for (ip, host), reqs in by_pair.items():
        reqs.sort(key=lambda e: e["start"])
        busy_until = reqs[0]["end"]
        for prev, cur in itertools.pairwise(reqs):
            gap = cur["start"] - prev["start"]
            s.pairs += 1
            s.min_gap = gap if s.min_gap is None else min(s.min_gap, gap)
            if cur["start"] < busy_until - OVERLAP_TOLERANCE:
                s.overlaps += 1
                s.overlap_examples.append(f"{ip} on {host}: {cur['path']} started {busy_until - cur['start']:.3f}s "
                                          "before the previous request ended")
            if gap < interval - tolerance:
                s.violations += 1
                s.violation_examples.append(f"{ip} on {host}: {cur['path']} {gap * 1000:.0f} ms after the "
                                            "previous start")
            busy_until = max(busy_until, cur["end"])
    return s


# --- real crawls through the stack --------------------------------------------------------------------

#: The demo's Scrapy project (catalog spider): the wheel's copy, else the checkout's.
EXAMPLE_PROJECT = default_project()


@dataclass
class CrawlRun:
    """``hosts`` ``scrapy crawl catalog`` processes run against the stack, and what nginx saw."""

    hosts: list
    duration: float
    summary: LogSummary

    @property
    def items(self) -> list[dict]:
        return [item for h in self.hosts for item in h.items]

    def format(self) -> str:
        lines = ["What nginx saw (its access log)", self.summary.format(), "What the hosts did"]
        for h in self.hosts:
            shard = {k.rsplit("/", 1)[-1]: v for k, v in sorted(h.stats.items())
                     if k.startswith(("proxy_shard/bans", "proxy_shard/release", "proxy_shard/lease"))}
            lines.append(f"  {h.name}: exit {h.exit_code}, {sum(i.get('kind') == 'page' for i in h.items)} pages, "
                         f"{sum(i.get('kind') == 'failed' for i in h.items)} failed; {shard}; log {h.log_path}")
        lines.append(f"  {len(self.hosts)} hosts, {self.duration:.1f}s wall time")
        return "\n".join(lines)


def load_proxies(redis_url: str, stack: NginxStack, namespace: str, pool: str = "datacenter") -> None:
    """Put the stack's tinyproxies into ``pool`` (emptied first) in Redis."""
    import redis

    from scrapy_proxy_shard.engine.proxies import make_proxy
    from scrapy_proxy_shard.engine.store import PoolStore

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        for key in client.scan_iter(f"{{{namespace}:*", count=1000):
            client.delete(key)
        store = PoolStore(client, namespace=namespace, host_id="nginx-stack-loader")
        store.add_proxies(pool, [make_proxy(p.url, {"source_ip": p.source_ip}) for p in stack.proxy_list])
    finally:
        client.close()


def run_hosts(commands: dict[str, tuple[list[str], dict[str, str]]], cwd: Path, workdir: Path,
              deadline: float) -> list[tuple[str, subprocess.Popen]]:
    """Start one crawl process per name (its command and its whole environment) at once, each writing
    ``<name>.items.jsonl`` and ``<name>.log`` into ``workdir``; wait for all of them until ``deadline``
    (``time.monotonic()``), stopping those still running then."""
    procs = []
    for name, (cmd, env) in commands.items():
        full = [*cmd, "-O", str(workdir / f"{name}.items.jsonl"), "--logfile", str(workdir / f"{name}.log")]
        procs.append((name, subprocess.Popen(full, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, start_new_session=True)))
    for _, proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            terminate(proc)
    return procs


def run_catalog_crawl(stack: NginxStack, redis_url: str, workdir: Path, *, hosts: int = 3,
                      settings: dict[str, str] | None = None, namespace: str = "nginxstack",
                      timeout: float = 120.0, project: Path = EXAMPLE_PROJECT) -> CrawlRun:
    """Load the stack's proxies and run ``hosts`` ``scrapy crawl catalog`` processes of
    ``example_project/`` at once (one shard each, sharing one pool in Redis), pacing at the stack's
    rule unless ``settings`` says otherwise. Processes still running at ``timeout`` are stopped."""
    import sys

    from scrapy_proxy_shard.demo.run import HostRun, require_project

    require_project(project)
    workdir.mkdir(parents=True, exist_ok=True)
    load_proxies(redis_url, stack, namespace)
    merged = {"PROXY_SHARD_NAMESPACE": namespace, "PROXY_SHARD_MIN_INTERVAL": f"{stack.interval:g}",
              "PROXY_SHARD_SITE_CONCURRENCY": "1", "PROXY_SHARD_BAN_TTL": "10",
              "PROXY_SHARD_HOSTS": ",".join(f"host-{i}" for i in range(hosts)), **(settings or {})}
    extra = [arg for name, value in merged.items() for arg in ("-s", f"{name}={value}")]
    start_urls = ",".join(stack.index_urls())
    since = time.time()
    started = time.monotonic()
    commands = {}
    for i in range(hosts):
        name = f"host-{i}"
        commands[name] = ([sys.executable, "-m", "scrapy", "crawl", "catalog", "-a", f"start_urls={start_urls}",
                           "-a", f"shard={i}", "-a", f"shards={hosts}", "-s", f"PROXY_SHARD_HOST_ID={name}", *extra],
                          {**os.environ, "PROXY_SHARD_REDIS_URL": redis_url,
                           "STATS_DUMP_FILE": str(workdir / f"{name}.stats.json")})
    procs = run_hosts(commands, project, workdir, started + timeout)
    duration = time.monotonic() - started
    runs = []
    for name, proc in procs:
        stats_file, items_file = workdir / f"{name}.stats.json", workdir / f"{name}.items.jsonl"
        stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
        items = ([json.loads(line) for line in items_file.read_text().splitlines() if line.strip()]
                 if items_file.exists() else [])
        runs.append(HostRun(name, proc.returncode, stats, items, workdir / f"{name}.log"))
    return CrawlRun(runs, duration, stack.analyze(since=since))
