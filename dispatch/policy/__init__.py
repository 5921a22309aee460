"""Ranking without running anything: cost model, merge, diversity cap, memoized ranking.

Ranking without running anything: the shared cost model (`costmodel`), every
backend's tactics merged and scored (`merge`), the diversity cap that never starves a
family (`cap`) and the memoized per-bucket `ranking`. Imports `loading` and below."""
