"""The winner store: owns tuning-cache entries (`CacheEntry`), adoption and re-validation.

Tuned winners of one dispatcher: measured in this process, or read from the tuning
cache and re-validated against the installed backends before first use. The tuner
(`fp4_dispatch.tuning`) only measures and picks; the file (`fp4_dispatch.cache`) only
stores checked JSON; everything about what an entry means lives here.

A cached entry is used only when (in this order) it was measured in this environment
(`environment`: library, torch, Triton, CuTe-DSL and cutlass-operators versions, CUDA
driver, GPU name and SM count; any difference makes it stale), its backend is loaded,
available and of the measured version, its tactic still parses and validates, and -
on its first use in a process - its kernel's output matches the float64 reference on
random inputs (`fp4_dispatch.tuning.verify_candidate`; opt out with
``Dispatcher(verify_cache=False)`` or ``FP4_DISPATCH_VERIFY_CACHE=0``). A stale or wrong
entry is ignored with one warning naming the cache file (the bucket runs untuned, or is
re-tuned under ``autotuning()``). Entries written before the environment was recorded
have no ``env`` field: they are treated as stale ("no environment record"), never
migrated, because nothing says which versions measured them.

An entry also records its ``operation``, the problem's ("w4a4" | "w4a16" | "w4a8": a
dense call under ``precision="fp8"``; an entry without one is "w4a4", all that was tuned
before), ``winner_operation``, what the winner computes ("w4a16" or the lossy "w4a8" for
a "w4a8" problem; absent in older entries: the problem's), its measurement policy
``measure`` ("graph" | "eager"; without one it is read from ``method``: "wall-clock" and
"cuda-eager" are eager) and the never-loses check: ``kept_default`` (the measured winner
was not faster than the heuristic default beyond the noise band in the paired check, so
the default is the entry's tactic), ``paired_ratio`` (median winner / default of the
pairs), ``pairs``, ``decision`` (one line) and ``challenger`` (the tactic that lost the
check).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, WrapValidator

from . import tuning
from .buckets import DEFAULT_OPERATION, BucketKey, bucket_key, describe
from .cache import CacheReadOnlyError, ImportReport, TuningCache
from .device import DeviceInfo
from .ranking import Candidate, estimate_us, m_bucket, operation_for
from .tactics import Problem
from .version import __version__

if TYPE_CHECKING:
    from .dispatcher import Dispatcher

log = logging.getLogger(__name__)

ENV_VERIFY = "FP4_DISPATCH_VERIFY_CACHE"
#: distribution name -> environment field: the packages whose version decides a
#: kernel's speed (code generators and the library's own kernels)
_PACKAGES = {
    "fp4-dispatch": "fp4_dispatch",
    "torch": "torch",
    "triton": "triton",
    "nvidia-cutlass-dsl": "cutlass_dsl",
    "nvidia-cutlass-operators": "cutlass_operators",
}


def verify_default() -> bool:
    """``FP4_DISPATCH_VERIFY_CACHE`` (default on; 0/false/no/off turn it off)."""
    return os.environ.get(ENV_VERIFY, "1").strip().lower() not in {"0", "false", "no", "off"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def cuda_driver_version() -> str | None:
    """The CUDA driver's version (``cuDriverGetVersion``, e.g. "12.4"), None without one.

    Read from libcuda directly: torch reports the runtime it was built with, not the
    driver, and the driver's JIT and scheduling change kernel speed."""
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
        value = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(value)) != 0:
            return None
    except (OSError, AttributeError) as exc:  # no driver on this machine
        log.debug("no CUDA driver (%s): %r", name, exc)
        return None
    return f"{value.value // 1000}.{value.value % 1000 // 10}"


def environment(device: DeviceInfo) -> dict[str, Any]:
    """What decides a kernel's speed besides its tactic: recorded in every cache entry."""
    env: dict[str, Any] = {field: _version(dist) for dist, field in _PACKAGES.items()}
    env["cuda_driver"] = cuda_driver_version() if device.kind == "cuda" else None
    env["gpu"] = device.name
    env["sm_count"] = device.sm_count
    return env


def environment_mismatch(recorded: object, current: Mapping[str, Any]) -> str | None:
    """Why an entry's recorded environment is not this one (None when it is)."""
    if not isinstance(recorded, Mapping):
        return ("entry has no environment record (written by an older fp4-dispatch); "
                "re-tune to use it")  # fmt: skip
    diffs = [
        f"{key} {recorded.get(key)!r} -> {current.get(key)!r}"
        for key in sorted(set(recorded) | set(current))
        if recorded.get(key) != current.get(key)
    ]
    return f"measured in another environment: {', '.join(diffs)}" if diffs else None


class StaleEntry(ValueError):
    """A cached winner that this process cannot use (the message says why)."""


def _or_none(value: Any, handler: Any) -> Any:
    """Optional fields: a value of another type (another version, a hand edit) is None.

    The file layer only checks the key and required fields, so whatever it accepts must
    also parse here; an odd optional value is informational, never a reason to fail."""
    try:
        return handler(value)
    except ValidationError:
        return None


_OptStr = Annotated[str | None, WrapValidator(_or_none)]
_OptInt = Annotated[int | None, WrapValidator(_or_none)]
_OptFloat = Annotated[float | None, WrapValidator(_or_none)]
_OptDict = Annotated[dict[str, Any] | None, WrapValidator(_or_none)]
_OptBool = Annotated[bool | None, WrapValidator(_or_none)]

#: ``method`` values of eager timings (entries that predate the ``measure`` field)
_EAGER_METHODS = {"wall-clock", "cuda-eager"}


class CacheEntry(BaseModel):
    """One tuned winner as the cache file stores it (format in `fp4_dispatch.cache`).

    Required fields are the ones the file checks (`fp4_dispatch.cache.REQUIRED`);
    the others are optional and lenient (`_or_none`); unknown fields (a newer version's)
    are kept and written back. ``env`` is the environment it was measured in
    (`environment`); ``tactic`` is the tactic's ``mode="json"`` dict, parsed with the
    backend's own type only when the entry is used.
    """

    model_config = ConfigDict(extra="allow")

    device: str
    n: int
    k: int
    m_bucket: int
    out_dtype: str
    backend: str
    backend_version: str
    tactic: dict[str, Any]
    us: float
    family: _OptStr = None
    library_version: _OptStr = None
    est_us: _OptFloat = None
    runner_up: _OptDict = None
    heuristic: _OptDict = None
    noise_band: _OptFloat = None
    measured: _OptInt = None
    failed: _OptInt = None
    method: _OptStr = None
    timestamp: _OptStr = None
    env: _OptDict = None
    operation: _OptStr = None
    #: the expert count E of a grouped winner (a key field; absent for dense ones)
    groups: int | None = None
    winner_operation: _OptStr = None
    measure: _OptStr = None
    kept_default: _OptBool = None
    paired_ratio: _OptFloat = None
    pairs: _OptInt = None
    decision: _OptStr = None
    challenger: _OptDict = None
    #: how the winner's output was verified against the float64 reference ("tuning": the
    #: tuner's check of every raced candidate); a reader verifies it again on first use
    verified: _OptStr = None

    @property
    def op(self) -> str:
        """The entry's operation: "w4a4" when it has none (written before W4A16 tuning)."""
        return self.operation or DEFAULT_OPERATION

    @property
    def policy(self) -> str:
        """The measurement policy: ``measure``, else read from ``method`` (older entries)."""
        if self.measure in ("graph", "eager"):
            return self.measure
        return "eager" if self.method in _EAGER_METHODS else "graph"

    @property
    def bucket(self) -> BucketKey:
        return bucket_key(self.m_bucket, self.n, self.k, self.out_dtype, self.op, self.groups)

    @property
    def problem(self) -> Problem:
        return Problem(m=self.m_bucket, n=self.n, k=self.k, out_dtype=self.out_dtype,
                       operation=self.op, groups=self.groups)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The file's form: unset optional fields left out."""
        return self.model_dump(mode="json", exclude_none=True)

    @classmethod
    def from_result(
        cls, result: tuning.TuneResult, device: str, backend_version: str, env: dict[str, Any]
    ) -> CacheEntry:
        """The entry of a measured result with a winner (``device``: its fingerprint)."""
        assert result.winner is not None
        w, p = result.winner, result.problem

        def ref(c: Candidate | None, us: float) -> dict[str, Any] | None:
            if c is None:
                return None
            return {"backend": c.backend, "tactic": c.tactic.model_dump(mode="json"),
                    "us": us if math.isfinite(us) else None}  # fmt: skip

        method = next((m.method for m in result.measurements if _same(m.candidate, w)), None)
        return cls(
            device=device, n=p.n, k=p.k, m_bucket=p.m, out_dtype=p.out_dtype,
            backend=w.backend, backend_version=backend_version, family=w.family,
            library_version=__version__, tactic=w.tactic.model_dump(mode="json"),
            us=result.winner_us, est_us=w.est_us,
            runner_up=ref(result.runner_up, result.runner_up_us),
            heuristic=ref(result.heuristic, result.heuristic_us),
            noise_band=result.noise_band, measured=len(result.measurements),
            failed=len(result.failures), method=method or "unknown",
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"), env=env,
            operation=p.operation, groups=p.groups, winner_operation=w.operation,
            measure=result.measure,
            kept_default=result.kept_default, paired_ratio=_finite(result.paired_ratio),
            pairs=result.pairs, decision=result.decision or None,
            challenger=ref(result.challenger, result.runner_up_us)
            if result.kept_default else None, verified="tuning",
        )  # fmt: skip


def _same(a: Candidate, b: Candidate) -> bool:
    return a.backend == b.backend and a.tactic == b.tactic


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class TunedWinners:
    """Bucket -> valid tuned winner, backed by a `TuningCache` (None: memory only)."""

    def __init__(
        self, dispatcher: Dispatcher, cache: TuningCache | None, verify: bool | None = None
    ) -> None:
        self._d = dispatcher
        self.cache = cache
        #: check a cached winner's output on its first use in this process
        self.verify = verify_default() if verify is None else verify
        self._winners: dict[BucketKey, Candidate | None] = {}  # None: looked up, none usable
        self._entries: dict[BucketKey, CacheEntry] | None = None
        self.results: dict[BucketKey, tuning.TuneResult] = {}

    def entries(self) -> dict[BucketKey, CacheEntry]:
        """This device's cache entries by bucket (read once, lazily)."""
        if self._entries is None:
            self._entries = {}
            d = self._d
            if self.cache is not None and not d.device.is_simulated:
                try:
                    rows = self.cache.entries(device=d.device_fingerprint)
                except OSError as exc:  # unreadable cache: run untuned, say so
                    log.warning("tuning cache %s unreadable (%s); running untuned",
                                self.cache.path, exc)  # fmt: skip
                    rows = []
                for row in rows:
                    try:
                        e = CacheEntry.model_validate(row)
                    except ValidationError as exc:  # the file's check is looser: say so
                        log.warning("tuning cache %s: entry %s not usable: %s", self.cache.path,
                                    row.get("n"), exc)  # fmt: skip
                        continue
                    self._entries[e.bucket] = e
        return self._entries

    def bucket(self, bkey: BucketKey) -> Candidate | None:
        """The bucket's valid tuned winner: tuned here, or a cached entry re-validated."""
        if bkey in self._winners:
            return self._winners[bkey]
        cand = None
        entry = self.entries().get(bkey)
        if entry is not None:
            if self.verify and self._d._capturing():  # cannot run a check inside capture
                log.info("bucket %s: cached winner not verified yet "
                         "(CUDA-graph capture); heuristic used", describe(bkey))  # fmt: skip
                return None
            try:
                cand = self.validate(entry)
                if self.verify:
                    self._verify(cand, bkey)
            except StaleEntry as exc:
                cand = None
                log.warning("tuning cache %s: ignoring stale entry for %s: %s",
                            self.cache.path if self.cache else "-", describe(bkey),
                            exc)  # fmt: skip
        self._winners[bkey] = cand
        return cand

    def validate(self, entry: CacheEntry | Mapping[str, Any]) -> Candidate:
        """The entry's candidate if it is usable here; raises `StaleEntry`.

        Checks, in order: the environment it was measured in is this one
        (`environment_mismatch`); the backend is loaded and available on this device,
        its version is the one that was measured; the tactic parses with the backend's
        ``tactic_type`` (and names this backend); ``backend.validate`` accepts it for
        the bucket's problem."""
        if not isinstance(entry, CacheEntry):
            entry = CacheEntry.model_validate(dict(entry))
        if not (math.isfinite(entry.us) and entry.us > 0):  # no kernel runs in <= 0 us
            raise StaleEntry(f"measured time {entry.us!r} us is not a positive finite number")
        why = environment_mismatch(entry.env, environment(self._d.device))
        if why is not None:
            raise StaleEntry(why)
        d, name = self._d, entry.backend
        backend = d.registry.backends.get(name)
        if backend is None:
            raise StaleEntry(f"backend {name!r} is not installed (or its plugin failed to load)")
        if backend not in d.available:
            raise StaleEntry(f"backend {name!r} is not available on {d.device.name}")
        if entry.backend_version != backend.version:
            raise StaleEntry(
                f"measured with {name} version {entry.backend_version!r}, "
                f"installed is {backend.version!r}"
            )
        try:
            tactic = backend.tactic_type.model_validate_json(json.dumps(entry.tactic))
        except Exception as exc:  # pydantic ValidationError, or a plugin's own error: stale
            raise StaleEntry(f"tactic no longer parses for {name}: {exc}") from exc
        if tactic.backend != name:
            raise StaleEntry(f"tactic names backend {tactic.backend!r}, entry says {name!r}")
        op = operation_for(backend, entry.problem)
        if op is None or op != (entry.winner_operation or op):
            raise StaleEntry(f"backend {name!r} does not compute a {entry.op} problem as "
                             f"{entry.winner_operation or entry.op}")  # fmt: skip
        problem = entry.problem.as_operation(op)
        try:
            why = backend.validate(tactic, problem, d.device)
        except Exception as exc:  # a raising check counts as "not valid here"
            why = f"validate() raised {type(exc).__name__}: {exc}"
        if why is not None:
            raise StaleEntry(f"tactic is no longer valid for {problem}: {why}")
        est = _finite(entry.est_us)
        if est is None:
            est = estimate_us(problem, d.device, tactic)
        return Candidate(
            name, backend.family, tactic, float(est), f"tuned ({entry.us:.4g} us measured)", op
        )

    def cached_result(
        self, bkey: BucketKey, requested: tuple[int, int, int], measure: str | None = None
    ) -> tuning.TuneResult | None:
        """The result `Dispatcher.tune` returns for a bucket it need not measure: tuned in
        this process, or a valid (re-validated, verified) cache entry; else None.

        ``measure``: the policy asked for; a winner measured under another one is not a
        hit (the bucket is re-measured the way it will run)."""
        cand = self.bucket(bkey)
        if cand is None:
            return None
        if bkey in self.results:
            hit = self.results[bkey]
            return hit if measure in (None, hit.measure) else None
        entry = self.entries().get(bkey)
        if entry is None or measure not in (None, entry.policy):
            return None
        heuristic = self._d.ranker.pick(entry.m_bucket, entry.n, entry.k, entry.out_dtype,
                                        entry.op, entry.groups)  # fmt: skip
        h = entry.heuristic or {}
        same_pick = h.get("backend") == heuristic.backend and h.get(
            "tactic"
        ) == heuristic.tactic.model_dump(mode="json")
        heur_us = h.get("us") if same_pick else None
        ru_us = (entry.runner_up or {}).get("us")

        def num(x: object) -> float:
            ok = isinstance(x, (int, float)) and not isinstance(x, bool)
            return float(x) if ok else math.nan

        return tuning.TuneResult(
            problem=entry.problem,
            source="cache",
            winner=cand,
            winner_us=entry.us,
            heuristic=heuristic,
            heuristic_us=num(heur_us),
            runner_up=None,
            runner_up_us=num(ru_us),
            noise_band=entry.noise_band if entry.noise_band is not None else tuning.NOISE_FLOOR,
            requested=requested,
            measure=entry.policy,
            paired_ratio=num(entry.paired_ratio),
            pairs=entry.pairs or 0,
            kept_default=bool(entry.kept_default),
            decision=entry.decision or "",
        )

    def _verify(self, cand: Candidate, bkey: BucketKey) -> None:
        """Run a cached winner once and compare with the reference; StaleEntry if wrong."""
        n, k, bucket, dtype, op = bkey[:5]
        groups = bkey[5] if len(bkey) > 5 else None
        problem = Problem(m=bucket, n=n, k=k, out_dtype=dtype, operation=op, groups=groups)
        d = self._d
        why = tuning.verify_candidate(cand, d.kernel_for, problem, d.device)
        if why is not None:  # a wrong kernel: never picked again, by the heuristic either
            d.guard.fault(cand.backend, "kernel() result", RuntimeError(why), cand.tactic,
                          quiet=True)  # fmt: skip
            d.guard.broken.add((cand.backend, cand.tactic))
            d.ranker.clear()
            raise StaleEntry(f"cached winner {cand.backend} gives a wrong result: {why}")
        d.first_use.mark(cand.backend, cand.tactic, bkey)

    def import_from(self, path: str | os.PathLike[str], *, replace: bool = False) -> ImportReport:
        """Merge another machine's cache file into this one (``cache import``).

        An entry is taken when it is for this device, usable here (`validate`: same
        environment, backend, version, valid tactic) and its bucket has no entry yet
        (unless ``replace``). Raises like `TuningCache.import_from`."""
        if self.cache is None:
            raise ValueError("cache: this dispatcher keeps winners in memory only (cache=False)")
        here = self._d.device_fingerprint

        def accept(entry: dict[str, Any]) -> str | None:
            if entry["device"] != here:
                return f"tuned on {entry['device']}, this device is {here}"
            try:
                self.validate(entry)
            except StaleEntry as exc:
                return str(exc)
            return None

        report = self.cache.import_from(path, accept, replace=replace)
        self._entries = None  # read the merged file on next use
        self._winners = {b: c for b, c in self._winners.items() if b in self.results}
        return report

    def pick(
        self,
        m: int,
        n: int,
        k: int,
        dtype: str,
        operation: str = DEFAULT_OPERATION,
        groups: int | None = None,
    ) -> Candidate | None:
        """The bucket's winner if it is also valid at this exact M (else None)."""
        bucket = m_bucket(m)
        cand = self.bucket(bucket_key(m, n, k, dtype, operation, groups))
        if cand is None or m == bucket:
            return cand
        d = self._d
        backend = d.registry.backends[cand.backend]
        try:
            exact = Problem(m=m, n=n, k=k, out_dtype=dtype, operation=cand.operation,
                            groups=groups)  # fmt: skip
            why = backend.validate(cand.tactic, exact, d.device)
        except Exception as exc:  # a raising check counts as "not valid here"
            why = f"validate() raised {type(exc).__name__}: {exc}"
        if why is not None:
            log.info("tuned pick of bucket M<=%d is invalid at M=%d (%s); heuristic used",
                     bucket, m, why)  # fmt: skip
            return None
        return cand

    def adopt(self, result: tuning.TuneResult, save: bool) -> None:
        """Use a measured winner from now on; merge it into the cache file when `save`."""
        bkey = result.bucket
        self._winners[bkey] = result.winner
        self.results[bkey] = result
        if result.winner is not None:  # the tuner checked it against the reference
            self._d.first_use.mark(result.winner.backend, result.winner.tactic, bkey)
        if save and self.cache is not None:
            self._save(bkey, result)

    def _save(self, bkey: BucketKey, result: tuning.TuneResult) -> None:
        d = self._d
        assert result.winner is not None
        version = d.registry.backends[result.winner.backend].version
        entry = CacheEntry.from_result(result, d.device_fingerprint, version,
                                       environment(d.device))  # fmt: skip
        self.entries()[bkey] = entry
        metadata = {
            "library": "fp4-dispatch",
            "library_version": __version__,
            "torch": torch.__version__,
            "devices": {
                d.device_fingerprint: {
                    "name": d.device.name,
                    "compute_capability": d.device.compute_capability,
                    "sm_count": d.device.sm_count,
                    "kind": d.device.kind,
                }
            },
            "backends": {b.name: b.version for b in d.available},
        }
        try:
            self.cache.put([entry.to_json()], metadata)
        except CacheReadOnlyError as exc:  # the cache warned once when it read the file
            log.info("tuning cache %s: not saved (%s); winner kept in memory", self.cache.path,
                     exc)  # fmt: skip
        except (OSError, TimeoutError) as exc:  # the winner is still used in this process
            log.warning("tuning cache %s: could not save (%s); winner kept in memory only",
                        self.cache.path, exc)  # fmt: skip
