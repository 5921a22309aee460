"""Plugins in: entry-point loading, the guard around plugin code, status rows, profiles.

Plugins in: entry-point loading (`registry`), the guard every call into plugin code
goes through (`guard`), the ``list-backends`` rows (`status`) and device profiles the
families contribute (`profiles`). Imports only the bottom layer."""
