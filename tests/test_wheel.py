"""The package as a user gets it: ``python -m build`` makes an sdist and a wheel (from that sdist) that pass
``twine check``; the wheel holds the Lua scripts and the demo's Scrapy project; installed into a fresh
virtualenv outside the checkout (its dependencies from the package index, as ``pip install`` does), its
console script answers ``--version`` and ``python -m scrapy_proxy_shard.demo`` runs a small demo to a
pass, with the package imported from that virtualenv, never from this tree.

Slow (a few minutes: two virtualenvs, an isolated build, the dependencies' downloads) and needs the
package index, like ``pip install -e '.[test]'`` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from scrapy_proxy_shard import __version__
from scrapy_proxy_shard.demo.redis_server import find_redis_servers

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as the tomli backport (pip and setuptools bring it)
    tomllib = pytest.importorskip("tomli")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parent.parent
#: What the copy of the tree the build starts from leaves out (local state, never in a clone).
NOT_SOURCE = (".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache",
              "demo-output")


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would make a child import the package from here."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PIP_REQUIRE_VIRTUALENV")
           and not k.startswith(("PROXY_SHARD_", "SCRAPY_"))}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1", **extra}


def _run(cmd: list, cwd: Path, timeout: float = 600, **extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_clean_env(**extra), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _venv(path: Path) -> Path:
    """A fresh virtualenv (no system site-packages); its python."""
    _run([sys.executable, "-m", "venv", path], cwd=path.parent)
    return path / "bin" / "python"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist and wheel built by ``python -m build`` (the ``release`` extra's tools, in a venv of their own)
    from a copy of this tree, so the build leaves nothing in the checkout."""
    base = tmp_path_factory.mktemp("build")
    source = base / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    tools = _venv(base / "tools")
    release = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["release"]
    _run([tools, "-m", "pip", "install", "-q", *release], cwd=base)
    out = base / "dist"
    _run([tools, "-m", "build", "--outdir", out, source], cwd=base)  # the sdist, then the wheel from it
    checked = _run([tools, "-m", "twine", "check", "--strict", *sorted(out.iterdir())], cwd=base)
    assert checked.stdout.count("PASSED") == 2, checked.stdout
    return out


def test_sdist_and_wheel_hold_the_scripts_the_demo_project_and_one_version(dist):
    [wheel] = dist.glob("*.whl")
    [sdist] = dist.glob("*.tar.gz")
    assert wheel.name == f"scrapy_proxy_shard-{__version__}-py3-none-any.whl"
    assert sdist.name == f"scrapy_proxy_shard-{__version__}.tar.gz"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = whl.read(metadata).decode()
    lua = {f"scrapy_proxy_shard/engine/lua/{p.name}" for p in (ROOT / "scrapy_proxy_shard/engine/lua").glob("*.lua")}
    assert len(lua) > 10 and lua <= names
    project = {f"scrapy_proxy_shard/demo/example_project/{p.relative_to(ROOT / 'example_project')}"
               for p in (ROOT / "example_project").rglob("*")
               if p.is_file() and (p.suffix == ".py" or p.name == "scrapy.cfg") and "__pycache__" not in p.parts}
    assert "scrapy_proxy_shard/demo/example_project/shardshop/spiders/shop.py" in project and project <= names
    assert "scrapy_proxy_shard/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "example_project/")) or ".pyc" in n]
    assert f"Version: {__version__}\n" in meta and "example.invalid" not in meta
    assert "Provides-Extra: release" in meta and "Description-Content-Type: text/markdown" in meta
    with tarfile.open(sdist) as tar:
        inside = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"CHANGELOG.md", "README.md", "setup.py", "example_project/scrapy.cfg",
            "example_project/shardshop/settings.py", "scrapy_proxy_shard/engine/lua/lease.lua"} <= inside


def test_the_wheel_installed_in_a_fresh_venv_runs_the_cli_and_the_demo(dist, tmp_path):
    [wheel] = dist.glob("*.whl")
    python = _venv(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "-q", wheel], cwd=tmp_path)
    away = tmp_path / "elsewhere"  # not the checkout, nor a Scrapy project
    away.mkdir()
    where = _run([python, "-c", "import scrapy_proxy_shard, importlib.metadata as m; "
                  "print(scrapy_proxy_shard.__file__); print(m.version('scrapy-proxy-shard'))"], cwd=away)
    location, version = where.stdout.split()
    assert Path(location).resolve().is_relative_to((tmp_path / "venv").resolve()), location
    assert version == __version__
    script = _run([tmp_path / "venv" / "bin" / "scrapy-proxy-shard", "--version"], cwd=away)
    assert script.stdout.strip() == f"scrapy-proxy-shard, version {__version__}"
    # The demo: its own redis-server (the newest line here), site, proxies and two `scrapy crawl` hosts of
    # the project the wheel ships; exit 0 only when every check passes.
    redis_server = find_redis_servers()[-1].path
    demo = subprocess.run([str(python), "-m", "scrapy_proxy_shard.demo", "--hosts", "2", "--pages", "5", "--flows",
                           "1", "--workdir", str(tmp_path / "demo"), "--timeout", "240"], cwd=away,
                          env=_clean_env(REDIS_SERVER=redis_server), capture_output=True, text=True, timeout=400)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    assert "[FAIL]" not in demo.stdout and "[PASS] every expected page scraped" in demo.stdout
