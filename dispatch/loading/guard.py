"""One guard for every call into plugin code: contain, check, attribute, record.

Why: a plugin is third-party code running inside the user's process. Before this
module, ``sys.exit()`` in a plugin's import ended every process that built a
`Dispatcher`, and ``supports()`` returning ``True`` (not a `Support`) raised on every
call. Every call into a plugin (import, hook, ``supports``, ``tactics``,
``estimate_us``, ``validate``, ``build`` and the built kernel) goes through `contain`
(catch) and, at run time, through `Guard` (check the returned type, attribute the
fault to plugin + backend + tactic, record it once, and raise `PluginFault` in strict
mode).

What is caught: `Exception`, `SystemExit`, `GeneratorExit` and any other
`BaseException` a plugin raises, except `KeyboardInterrupt` (a real Ctrl-C must still
stop the process; a plugin that raises KeyboardInterrupt itself cannot be told apart).
What cannot be contained in one process: a plugin that monkeypatches torch or this
package, calls ``os._exit``, segfaults, or never returns. Those need a subprocess
(`fp4_dispatch.testing`'s conformance kit is the place to find them before release).
"""

from __future__ import annotations

import logging
import math
import time
import traceback as _tb
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from fp4_dispatch.contracts.backend import GemmOperands, Kernel, Support
from fp4_dispatch.contracts.backend import launch as _launch
from fp4_dispatch.contracts.tactics import Tactic

log = logging.getLogger(__name__)

T = TypeVar("T")

#: distinct faults kept per dispatcher: a plugin whose messages vary on every call (ids,
#: times) must not grow the record without bound; strict mode still raises every time
MAX_FAULTS = 1000
#: one call into plugin code (``supports``, ``tactics``, ``validate``, ``build``) slower
#: than this many seconds is named in a warning when it returns: a 30 s ``build()`` or a
#: ``supports()`` that allocates 20 GB otherwise just makes the first call or
#: ``Dispatcher()`` slow, with nothing saying whose code it was
SLOW_CALL_S = 1.0


@dataclass(frozen=True)
class Fault:
    """One contained failure of plugin code, attributed as precisely as known."""

    plugin: str
    backend: str
    call: str
    error_type: str
    message: str
    tactic: str = ""
    traceback: str = ""

    def __str__(self) -> str:
        where = f"backend {self.backend!r}" if self.backend else "its hook"
        tactic = f" tactic {self.tactic}" if self.tactic else ""
        return f"plugin {self.plugin!r} {where}{tactic}: {self.what}"

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    @property
    def what(self) -> str:
        """Short form without the attribution: ``tactics() raised ValueError: ...``."""
        if self.error_type == BadReturn.__name__:
            return f"{self.call} {self.message}"
        return f"{self.call} raised {self.error_type}: {self.message}"


class PluginFault(RuntimeError):
    """A plugin's code failed (strict mode raises this; non-strict records it).

    The message names the plugin, backend, tactic, the call and the original exception
    (kept as ``__cause__`` where there is one).
    """

    def __init__(self, fault: Fault):
        super().__init__(str(fault))
        self.fault = fault


class PluginExit(RuntimeError):
    """A plugin's kernel raised SystemExit (or another non-Exception BaseException).

    `launch` turns it into this ordinary error (the original is ``__cause__``) so that
    every caller that contains kernel failures with ``except Exception`` (the tuner,
    doctor, the conformance kit) contains it too.
    """


def launch(kernel: Kernel, operands: GemmOperands, out: Any, swap_ab: bool) -> None:
    """`fp4_dispatch.contracts.backend.launch`, with a kernel's SystemExit (or any non-Exception
    BaseException, Ctrl-C aside) raised as `PluginExit`. The try costs nothing (3.11)."""
    try:
        _launch(kernel, operands, out, swap_ab)
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as exc:  # plugin code must not end the process: an error instead
        raise PluginExit(f"kernel raised {type(exc).__name__}: {exc}") from exc


def launch_candidate(candidate: Any, kernel: Kernel, operands: GemmOperands, out: Any) -> Any:
    """`launch` for a ranked candidate (its tactic's ``swap_ab``); returns ``out``.

    The tuner, the conformance kit and benchmarks that hold a `Candidate` use this
    (``fp4_dispatch.engine.dispatcher.launch`` is the same function).
    """
    launch(kernel, operands, out, candidate.tactic.swap_ab)
    return out


class BadReturn(TypeError):
    """A plugin call returned something of the wrong type or value (not an exception)."""


def contain(
    fn: Callable[..., T], *args: Any, **kwargs: Any
) -> tuple[T | None, BaseException | None]:
    """Call `fn`; return ``(value, None)`` or ``(None, exception)`` for anything but Ctrl-C."""
    try:
        return fn(*args, **kwargs), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit & co. from a plugin: returned, never lost
        return None, exc


def describe(exc: BaseException) -> tuple[str, str, str]:
    """(type name, message, traceback text) of an exception, SystemExit's code included."""
    message, failed = contain(str, exc)
    if failed is not None:  # a hostile __str__ must not escape the guard either
        message = f"<str() of the exception raised {type(failed).__name__}>"
    if isinstance(exc, SystemExit):
        message = f"sys.exit({exc.code!r}) called by the plugin"
    trace = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__))
    return type(exc).__name__, message, trace


@dataclass
class Guard:
    """Calls into one registry's backends for a dispatcher, with its strictness.

    ``plugin_of``: backend name -> plugin (entry point) name, for attribution.
    ``faults``: every distinct fault recorded so far (shared with the registry, so that
    ``list-backends`` and ``explain`` show it). ``broken``: (backend, tactic) pairs that
    failed to build or run in this process: never chosen again.
    """

    strict: bool = False
    plugin_of: dict[str, str] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    broken: set[tuple[str, Tactic]] = field(default_factory=set)
    #: backend -> call -> [calls, total seconds, longest seconds] of its guarded hooks
    #: (``estimate_us`` is not timed: thousands of calls per ranking)
    hook_times: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    _seen: set[tuple[str, ...]] = field(default_factory=set, repr=False)

    # ---- timing -----------------------------------------------------------------------

    def _timed(self, backend: Any, call: str, fn: Callable[..., T], *args: Any):
        """`contain` (fn(*args)) with its wall time recorded, and warned about when slow."""
        t0 = time.perf_counter()
        try:
            return contain(fn, *args)
        finally:
            self._took(backend.name, call, time.perf_counter() - t0)

    def _took(self, name: str, call: str, seconds: float) -> None:
        stats = self.hook_times.setdefault(name, {}).setdefault(call, [0, 0.0, 0.0])
        stats[0] += 1
        stats[1] += seconds
        stats[2] = max(stats[2], seconds)
        if seconds > SLOW_CALL_S:
            log.warning("plugin %r backend %r: %s took %.1f s (slow plugin code; "
                        "list-backends shows its hook times)", self.plugin_of.get(name, "?"),
                        name, call, seconds)  # fmt: skip

    def hook_summary(self, name: str) -> dict[str, dict[str, float]]:
        """``{call: {"calls", "seconds", "max_s"}}`` of one backend's timed hooks."""
        return {call: {"calls": int(n), "seconds": total, "max_s": longest}
                for call, (n, total, longest) in self.hook_times.get(name, {}).items()}  # fmt: skip

    # ---- recording --------------------------------------------------------------------

    def fault(
        self,
        backend: str,
        call: str,
        exc: BaseException,
        tactic: Tactic | None = None,
        plugin: str | None = None,
        quiet: bool = False,
    ) -> PluginFault:
        """Record a fault (once per distinct one) and return the error strict mode raises.

        ``quiet``: log at INFO, not WARNING, because the caller warns itself (the
        dispatcher's fallback says once which backend and tactic it leaves).
        """
        error_type, message, trace = describe(exc)
        f = Fault(
            plugin=plugin or self.plugin_of.get(backend, "?"),
            backend=backend,
            call=call,
            error_type=error_type,
            message=message,
            tactic="" if tactic is None else _tactic_text(tactic),
            traceback=trace,
        )
        key = (f.plugin, f.backend, f.call, f.tactic, f.error_type, f.message)
        if key not in self._seen and len(self._seen) < MAX_FAULTS:
            self._seen.add(key)
            self.faults.append(f)
            log.log(logging.INFO if quiet else logging.WARNING, "%s", f)
            if len(self._seen) == MAX_FAULTS:
                log.warning("%d plugin faults recorded: further ones are not", MAX_FAULTS)
        err = PluginFault(f)
        err.__cause__ = exc if not isinstance(exc, BadReturn) else None
        return err

    def failed(
        self, backend: str, call: str, exc: BaseException, tactic: Tactic | None = None
    ) -> PluginFault:
        """Record a fault; raise it in strict mode."""
        err = self.fault(backend, call, exc, tactic)
        if self.strict:
            raise err
        return err

    # ---- the guarded calls ------------------------------------------------------------

    def supports(self, backend: Any, device: Any) -> Support | PluginFault:
        """``backend.supports(device)`` as a `Support`, or the recorded fault."""
        value, exc = self._timed(backend, "supports()", backend.supports, device)
        if exc is None and not isinstance(value, Support):
            exc = BadReturn(f"returned {_short(value)}, expected an fp4_dispatch.Support")
        if exc is not None:
            return self.failed(backend.name, "supports()", exc)
        return value

    def tactics(self, backend: Any, problem: Any, device: Any) -> list[Any] | PluginFault:
        """Every tactic ``backend.tactics`` yields (the iteration guarded too), or the fault."""

        def collect() -> list[Any]:
            got = backend.tactics(problem, device)
            if got is None or isinstance(got, (str, bytes)) or not isinstance(got, Iterable):
                raise BadReturn(f"returned {_short(got)}, expected an iterable of tactics")
            return list(got)

        value, exc = self._timed(backend, "tactics()", collect)
        if exc is not None:
            return self.failed(backend.name, "tactics()", exc)
        return value

    def bad_tactics(self, backend: Any, count: int, first: str) -> None:
        """Tactics of the wrong type, another backend's, or invalid: a recorded fault."""
        exc = BadReturn(f"{count} invalid tactic(s) returned; first: {first}")
        self.failed(backend.name, "tactics()", exc)

    def estimate_us(
        self, backend: Any, problem: Any, device: Any, tactic: Tactic
    ) -> float | PluginFault | None:
        """The backend's own estimate; None keeps the shared model; the fault when unusable.

        Called once per tactic in every ranking (thousands): the usual answer, a finite
        non-negative float, takes the first branch (no extra call, no isinstance).
        """
        try:
            value = backend.estimate_us(problem, device, tactic)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # recorded; the caller keeps the shared model
            return self.failed(backend.name, "estimate_us()", exc, tactic)
        if type(value) is float and 0.0 <= value < math.inf:
            return value
        if value is None:
            return None
        if _finite_non_negative(value):
            return float(value)
        exc = BadReturn(f"returned {_short(value)}, expected None or a finite float >= 0")
        return self.failed(backend.name, "estimate_us()", exc, tactic)

    def validate(self, backend: Any, tactic: Tactic, problem: Any, device: Any) -> str | None:
        """None when valid, else why not (a fault counts as "not valid here")."""
        value, exc = self._timed(backend, "validate()", backend.validate, tactic, problem, device)
        if exc is None and value is not None and not isinstance(value, str):
            exc = BadReturn(f"returned {_short(value)}, expected None or a str")
        if exc is not None:  # a check that fails cannot vouch for its tactic: not used again
            self.broken.add((backend.name, tactic))
            err = self.failed(backend.name, "validate()", exc, tactic)
            return str(err)
        return value

    def build(self, backend: Any, tactic: Tactic, problem: Any, device: Any) -> Callable:
        """``backend.build(...)``, checked to be callable; the fault is recorded otherwise.

        An `Exception` from the plugin is re-raised as itself (callers such as the tuner
        report its own type and message) with the recorded `PluginFault` attached as
        ``exc.plugin_fault``; SystemExit & co. and a non-callable result raise the
        `PluginFault` (they must not end the process or be called).
        """
        value, exc = self._timed(backend, "build()", backend.build, tactic, problem, device)
        if exc is None and not callable(value):
            exc = BadReturn(f"returned {_short(value)}, expected a callable kernel")
        if exc is None:
            return value
        self.broken.add((backend.name, tactic))
        err = self.fault(backend.name, "build()", exc, tactic, quiet=True)
        if isinstance(exc, Exception) and not isinstance(exc, BadReturn):
            _, attach_failed = contain(setattr, exc, "plugin_fault", err)
            if attach_failed is None:
                raise exc
        raise err


def _finite_non_negative(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value >= 0


def _short(value: object) -> str:
    text, failed = contain(repr, value)
    if failed is not None:
        text = f"<repr() raised {type(failed).__name__}>"
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _tactic_text(tactic: object) -> str:
    try:
        return tactic.canonical_json()  # type: ignore[attr-defined]
    except Exception as exc:  # a tactic that cannot even dump: its repr, and why
        log.debug("tactic %r has no canonical JSON: %r", tactic, exc)
        return repr(tactic)
