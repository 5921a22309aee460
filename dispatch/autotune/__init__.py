"""Measurement: one timing/numerics harness, timers, precompiles, the tuner.

`harness` is shared by the tuner, the CLI, the conformance kit and the benchmarks;
`timers` are built on it; `precompile` and `precompile_worker` compile ahead of time in
worker processes; `tuning` measures a shortlist and returns a winner; `distributed` makes
ranks tune together. Tuning ends at a measurement: nothing here writes the cache (that is
`fp4_dispatch.store`).
"""
