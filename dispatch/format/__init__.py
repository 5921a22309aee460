"""The NVFP4 number format: the tensor type, reference arithmetic and argument checks.

`nvfp4` is the format and its float64 reference, `grouped` the stacked expert weights
(`Nvfp4Experts`) and their per-expert reference, `checks` the argument checks of every
public call. Bottom layer: imports nothing of the project above it (the fused
activation quantizer in ``fp4_dispatch.backends.quantize`` is the one kernel it calls: a
shared kernel of the format, not a family).
"""
