"""Leaf utilities any layer may use: progress bars, owned files, kernel-source digests.

`progress` (bars), `safefs` (read, lock, replace only regular files the library owns),
`sources` (digests that version a backend by its code), `optional` (optional Triton code
looked up once) and `alloc` (the fast paths' tensor allocation). Imports nothing of the
project.
"""
