"""Plugins in: entry-point loading, the guard around plugin code, status rows, profiles.

`registry` (loading by plugin name, then one backend filter), `guard` (every call into
plugin code goes through it), `status` (the ``list-backends`` rows) and `profiles`
(device profiles the families contribute). Imports only the bottom layer.
"""
