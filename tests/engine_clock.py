"""The time the engine sees in tests, shared by the contract and adaptive-pacing suites.

Real servers: the wall clock, and ``sleep`` sleeps. fakeredis: a controlled clock that ``sleep``
advances at once; fakeredis reads it for ``TIME`` (what the Lua scripts go by) and for key expiry, so
TTLs, intervals and bans elapse without real waiting (blocking commands still time out in real time).
"""

from __future__ import annotations

import importlib
import time
import types

import fakeredis.commands_mixins.server_mixin

# The module whose time.time() decides key expiry: fakeredis moved it (2.26: _basefakesocket; later
# releases: _socket._base). The lowest-versions CI run uses the old one.
_SOCKET_MODULES = ("fakeredis._socket._base", "fakeredis._basefakesocket")


def _socket_module() -> types.ModuleType:
    for name in _SOCKET_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {_SOCKET_MODULES} in this fakeredis: tests/engine_clock.py needs updating")


class Clock:
    def __init__(self, controlled: bool) -> None:
        self.controlled = controlled
        self.slack = 0.0  # real time calls took on a real server (test_engine_contract._wait_after)
        # Half a millisecond past a whole second: the scripts floor TIME to whole ms, and a clock on
        # a ms boundary could read 1 ms short after float sums (N + 0.305 stored as N + 0.30499999...),
        # which made an exact-wait assertion fail on some start times. Sleeps are whole ms in the tests.
        self._now = int(time.time()) + 0.0005

    def time(self) -> float:
        return self._now if self.controlled else time.time()

    def sleep(self, seconds: float) -> None:
        if self.controlled:
            self._now += max(0.0, seconds)
        else:
            time.sleep(max(0.0, seconds))


def make_clock(controlled: bool, monkeypatch) -> Clock:
    """A clock; a controlled one is installed into fakeredis: its modules call ``time.time()``, so
    they get a stand-in whose ``time`` is the clock."""
    clock = Clock(controlled)
    if controlled:
        stand_in = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if name[0] != "_"})
        stand_in.time = clock.time
        for module in (_socket_module(), fakeredis.commands_mixins.server_mixin):
            monkeypatch.setattr(module, "time", stand_in)
    return clock
