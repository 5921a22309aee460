"""Leaf utilities any layer may use: progress bars, owned files, kernel-source digests.

`progress` (bars), `safefs` (read, lock, replace only regular files the library owns)
and `sources` (digests that version a backend by its code). Imports nothing of the
project.
"""
