"""Tuned winners of one dispatcher: measured in this process, or read from the tuning
cache and re-validated against the installed backends before first use."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from . import tuning
from .cache import TuningCache
from .ranking import Candidate, m_bucket
from .tactics import Problem
from .version import __version__

if TYPE_CHECKING:
    from .dispatcher import Dispatcher

log = logging.getLogger(__name__)

#: (N, K, M bucket, out dtype): the unit a tuned winner covers
BucketKey = tuple[int, int, int, str]


class TunedWinners:
    """Bucket -> valid tuned winner, backed by a `TuningCache` (None: memory only)."""

    def __init__(self, dispatcher: Dispatcher, cache: TuningCache | None) -> None:
        self._d = dispatcher
        self.cache = cache
        self._winners: dict[BucketKey, Candidate | None] = {}  # None: looked up, none usable
        self._entries: dict[BucketKey, dict] | None = None
        self.results: dict[BucketKey, tuning.TuneResult] = {}

    def entries(self) -> dict[BucketKey, dict]:
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
                for e in rows:
                    self._entries[(e["n"], e["k"], e["m_bucket"], e["out_dtype"])] = e
        return self._entries

    def bucket(self, bkey: BucketKey) -> Candidate | None:
        """The bucket's valid tuned winner: tuned here, or a cached entry re-validated."""
        if bkey in self._winners:
            return self._winners[bkey]
        cand = None
        entry = self.entries().get(bkey)
        if entry is not None:
            try:
                cand = tuning.candidate_from_entry(entry, self._d)
            except tuning.StaleEntry as exc:
                log.warning("tuning cache %s: ignoring stale entry for N=%d K=%d M<=%d %s: %s",
                            self.cache.path if self.cache else "-", *bkey, exc)  # fmt: skip
        self._winners[bkey] = cand
        return cand

    def pick(self, m: int, n: int, k: int, dtype: str) -> Candidate | None:
        """The bucket's winner if it is also valid at this exact M (else None)."""
        bucket = m_bucket(m)
        cand = self.bucket((n, k, bucket, dtype))
        if cand is None or m == bucket:
            return cand
        d = self._d
        backend = d.registry.backends[cand.backend]
        try:
            why = backend.validate(cand.tactic, Problem(m=m, n=n, k=k, out_dtype=dtype), d.device)
        except Exception as exc:  # a raising check counts as "not valid here"
            why = f"validate() raised {type(exc).__name__}: {exc}"
        if why is not None:
            log.info("tuned pick of bucket M<=%d is invalid at M=%d (%s); heuristic used",
                     bucket, m, why)  # fmt: skip
            return None
        return cand

    def adopt(self, result: tuning.TuneResult, save: bool) -> None:
        """Use a measured winner from now on; merge it into the cache file when `save`."""
        p = result.problem
        bkey = (p.n, p.k, p.m, p.out_dtype)
        self._winners[bkey] = result.winner
        self.results[bkey] = result
        if save and self.cache is not None:
            self._save(bkey, result)

    def _save(self, bkey: BucketKey, result: tuning.TuneResult) -> None:
        d = self._d
        entry = tuning.to_entry(result, d, __version__)
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
            self.cache.put([entry], metadata)
        except (OSError, TimeoutError) as exc:  # the winner is still used in this process
            log.warning("tuning cache %s: could not save (%s); winner kept in memory only",
                        self.cache.path, exc)  # fmt: skip
