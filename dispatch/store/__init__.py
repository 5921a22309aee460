"""Caching starts at a winner store: the shared cache file and the store of its entries.

Caching starts at a winner store: the shared tuning-cache file (`cache`) and the store
that owns its entries, adopts tuned winners and re-validates cached ones (`winners`).
Imports `autotune` and below."""
