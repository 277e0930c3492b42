"""Waiting-dominated test scenarios run side by side, a bounded number at a time.

A scenario is a function that takes no argument, does its (mostly waiting) work, and returns
what it observed; the test that owns it makes the assertions on that value. A module-scoped
fixture builds a :class:`SideBySide` over the scenarios its selected tests need and starts it;
each test then calls :meth:`SideBySide.result` (or the module-level :func:`result`, which falls
back to running the scenario alone when the fixture did not launch it, e.g. under ``-k``).

Scenarios run in threads of the pytest process (they start and wait for subprocesses, so the
GIL is not the limit). ``capacity`` bounds the sum of the running scenarios' ``weight`` (say,
processes that import torch at once): a 2-core machine gains from overlapping waits, not from
more start-ups at once. Scenarios start in the order given, each as soon as it fits.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

__all__ = ["SideBySide", "result", "selected_names"]


def selected_names(request, module_name: str, scenarios_of: dict) -> list:
    """The scenario names that the session's selected tests of ``module_name`` need, in test
    order; ``scenarios_of`` maps a test function's name to a list of scenario names, or to a
    function of the test's parameters returning one."""
    names = []
    for item in request.session.items:
        if item.module.__name__ != module_name:
            continue
        wanted = scenarios_of.get(getattr(item, "originalname", None))
        if wanted is None:
            continue
        if callable(wanted):
            wanted = wanted(getattr(getattr(item, "callspec", None), "params", {}))
        names += [name for name in wanted if name not in names]
    return names


class SideBySide:
    """Run ``{name: (weight, fn)}`` scenarios in threads, at most ``capacity`` weight at once
    (a scenario heavier than ``capacity`` runs when nothing else does)."""

    def __init__(self, scenarios: dict[str, tuple[int, Callable[[], Any]]], capacity: int):
        self.scenarios = dict(scenarios)
        self.capacity = capacity
        self._done: dict[str, tuple[bool, Any]] = {}
        self._running: dict[str, int] = {}
        self._cond = threading.Condition()
        self._scheduler: Optional[threading.Thread] = None

    def start(self) -> "SideBySide":
        self._scheduler = threading.Thread(target=self._schedule, daemon=True,
                                           name="side-by-side")
        self._scheduler.start()
        return self

    def _schedule(self) -> None:
        for name, (weight, fn) in self.scenarios.items():
            with self._cond:
                while self._running and sum(self._running.values()) + weight > self.capacity:
                    self._cond.wait()
                self._running[name] = weight
            threading.Thread(target=self._run, args=(name, fn), daemon=True,
                             name=f"scenario {name}").start()

    def _run(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            outcome = (True, fn())
        except BaseException as error:  # handed to the test that asks for it
            outcome = (False, error)
        with self._cond:
            self._done[name] = outcome
            del self._running[name]
            self._cond.notify_all()

    def __contains__(self, name: str) -> bool:
        return name in self.scenarios

    def result(self, name: str, timeout: float = 600.0) -> Any:
        """Wait for scenario ``name`` and return its value (or raise what it raised)."""
        deadline = time.time() + timeout
        with self._cond:
            while name not in self._done:
                left = deadline - time.time()
                if left <= 0:
                    raise AssertionError(f"scenario {name!r} did not finish in {timeout:g} s")
                self._cond.wait(left)
            ok, value = self._done[name]
        if not ok:
            raise value
        return value

    def wait_all(self, timeout: float = 600.0) -> None:
        """Wait until every scenario has ended (what it raised stays for :meth:`result`)."""
        deadline = time.time() + timeout
        with self._cond:
            while len(self._done) < len(self.scenarios) and time.time() < deadline:
                self._cond.wait(max(0.0, deadline - time.time()))


def result(launched: Optional[SideBySide], name: str, fallback: Callable[[], Any]) -> Any:
    """``launched``'s result for ``name``, or ``fallback()`` run here and now when ``launched``
    did not include that scenario (a selection the fixture did not see)."""
    if launched is not None and name in launched:
        return launched.result(name)
    return fallback()
