"""Leaf utilities any layer may use: progress bars, owned files, kernel-source digests.

Leaf utilities any layer may use: progress bars (`progress`), the library's own files
(`safefs`: read, lock, replace only regular files it owns) and kernel-source digests
that version a backend by its code (`sources`). Imports nothing of the project."""
