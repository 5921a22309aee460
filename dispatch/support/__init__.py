"""Leaf utilities any layer may use: progress bars, owned files, kernel-source digests.

`progress` (bars), `safefs` (read, lock, replace only regular files the library owns),
`sources` (digests that version a backend by its code) and `optional` (optional Triton
code looked up once). Imports nothing of the project.
"""
