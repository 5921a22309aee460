"""Kernels, one module per kernel family. No dispatch logic here."""
