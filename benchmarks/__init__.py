"""Benchmark suites of fp4-dispatch: run ``python -m benchmarks --help`` (see __main__)."""
