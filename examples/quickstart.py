"""Quantize two matrices to NVFP4 and multiply them through the dispatcher."""

import torch

from fp4_dispatch import Dispatcher, quantize_nvfp4, reference_gemm

device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(64, 4096, device=device)  # activations [M, K]
w = torch.randn(1024, 4096, device=device)  # weight [N, K], like nn.Linear
qx, qw = quantize_nvfp4(x), quantize_nvfp4(w)

d = Dispatcher()
choice = d.select(64, 1024, 4096)
y = d.gemm(qx, qw, out_dtype=torch.bfloat16)  # [64, 1024]
ref = reference_gemm(qx, qw)
err = float((y.double().cpu() - ref).norm() / ref.norm())
print(f"device: {d.device.name}; ran {choice.backend} {choice.tactic.canonical_json()}")
print(f"y: {tuple(y.shape)} {y.dtype}; relative error vs float64 reference: {err:.2e}")
