"""What users hold: Nvfp4Linear, whole models and checkpoints, the conformance kit.

What users hold: `nn` (`Nvfp4Linear`), whole models (`convert`: quantize_model;
`checkpoints`, `ckpt_formats`, `ckpt_sources`, `ckpt_save`: ModelOpt and
compressed-tensors checkpoints; `hf`: from_pretrained) and the plugin conformance checks
(`conformance`, `conformance_report`; public face: ``fp4_dispatch.testing``).
Imports the engine and below."""
