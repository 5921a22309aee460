"""Measurement: one timing/numerics harness, timers, precompiles, the tuner.

Measurement: the one timing/numerics harness (`harness`) shared by the tuner, the CLI,
the conformance kit and the benchmarks; the timers built on it (`timers`); parallel
ahead-of-time compiles (`precompile`, `precompile_worker`); the tuner that measures a
shortlist and returns a winner (`tuning`); ranks that tune together (`distributed`).

Tuning ends at a measurement: nothing here writes the cache (that is `fp4_dispatch.store`).
"""
