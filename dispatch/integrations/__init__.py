"""What users hold: Nvfp4Linear, whole models and checkpoints, the conformance kit.

`nn` (`Nvfp4Linear`), `moe` (`Nvfp4MoE`), whole models (`convert`: quantize_model, with
`moe_convert`; `checkpoints`, `ckpt_formats`, `ckpt_sources`, `moe_ckpt`, `ckpt_save`:
ModelOpt and compressed-tensors checkpoints; `hf`: from_pretrained) and the plugin
conformance checks (`conformance`, `conformance_report`; public face:
``fp4_dispatch.testing``). Imports the engine and below.
"""
