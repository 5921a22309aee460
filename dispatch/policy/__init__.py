"""Ranking without running anything: cost model, merge, diversity cap, memoized ranking.

`costmodel` (the shared estimate), `merge` (every backend's tactics enumerated,
re-validated and scored), `cap` (a shortlist that never starves a family) and `ranking`
(the memoized per-bucket `Ranker`). Imports `loading` and below.
"""
