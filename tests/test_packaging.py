"""The lowest-versions constraints CI tests with (.ci/constraints-lowest.txt) stay equal to the bounds
pyproject.toml declares: a bound raised or added without the file (or the reverse) fails here, so the
second CI run always tests what a user with the oldest allowed packages gets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as the tomli backport (pip and setuptools bring it)
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def _declared_minimums() -> dict[str, Version]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for line in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(line)
        lows = [spec.version for spec in req.specifier if spec.operator in (">=", "==", "~=")]
        assert lows, f"{line!r} declares no lower bound: the lowest-versions run cannot test it"
        found[req.name.lower()] = Version(lows[0])
    return found


def _pinned() -> dict[str, Version]:
    pins = {}
    for raw in (ROOT / ".ci" / "constraints-lowest.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = Version(version.strip())
    return pins


# Pins of packages we do not declare (a dependency's own too-loose bound), each explained in the file.
TRANSITIVE: set[str] = set()


def test_lowest_constraints_pin_every_declared_minimum():
    pinned, declared = _pinned(), _declared_minimums()
    assert {name: pinned.get(name) for name in declared} == declared
    assert set(pinned) - set(declared) == TRANSITIVE
