"""Deliberately broken: shows that a plugin failing at import is recorded, not hidden."""

raise ImportError("fp4_dispatch_broken: simulated missing native library libfp4broken.so")
