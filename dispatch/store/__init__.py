"""Caching starts at a winner store: the shared cache file and the store of its entries.

`cache` is the tuning-cache file; `winners` owns its entries, adopts tuned winners and
re-validates cached ones. Imports `autotune` and below.
"""
