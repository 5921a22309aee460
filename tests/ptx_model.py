"""A small model of the PTX instructions the kernels' inline assembly uses, run on the CPU.

Why: inline PTX runs only on a GPU, so CPU CI never executed it; a one-bit change to a
dequantizer or an operand swap in a conversion left every CPU test green. This model
executes the straight-line blocks (registers as bit patterns in Python ints) with the
semantics of the PTX ISA for each instruction used, so a test can run a kernel's own
PTX text on every input that matters and compare with the format's definition.

Registers: 16/32-bit values as unsigned ints, ``.f32`` as float32 bits, ``.f64`` as
float64 bits, predicates as bools. Immediates: decimal, ``0x`` hex, ``0f`` float32 bits.
``prefetch`` is recorded in ``regs["prefetched"]`` (a list of addresses).
"""

from __future__ import annotations

import math
import re
import struct

import torch

M32 = 0xFFFFFFFF


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & M32))[0]


def f64_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def bits_f64(b: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", b))[0]


def _lanes_mul(a: int, b: int, dt: torch.dtype) -> int:
    def half(x: int) -> torch.Tensor:
        return torch.tensor([x & 0xFFFF], dtype=torch.int32).to(torch.int16).view(dt)

    out = 0
    for sh in (0, 16):
        p = (half(a >> sh).float() * half(b >> sh).float()).to(dt)
        out |= (int(p.view(torch.int16).item()) & 0xFFFF) << sh
    return out


def e4m3_satfinite(x: float) -> int:
    """``cvt.rn.satfinite.e4m3.f32`` of one value: nearest even, saturated to +-448,
    NaN to 0x7F."""
    if math.isnan(x):
        return 0x7F
    x = max(-448.0, min(448.0, x))
    return int(torch.tensor([x], dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8))


def _f64_to_f32(x: float, mode: str) -> int:
    """float32 bits of float64 `x` rounded toward -inf (``rm``) or +inf (``rp``)."""
    return f32_bits(_down32(x) if mode == "rm" else _up32(x))


def _down32(x: float) -> float:
    b = f32_bits(x)
    f = bits_f32(b)
    while f > x:
        b = b - 1 if f > 0 else b + 1
        f = bits_f32(b)
    return f


def _up32(x: float) -> float:
    b = f32_bits(x)
    f = bits_f32(b)
    while f < x:
        b = b + 1 if f >= 0 else b - 1
        f = bits_f32(b)
    return f


def statements(asm: str) -> list[str]:
    """The instructions of a block, one per item (braces and ``.reg`` declarations gone)."""
    out = []
    for part in re.split(r"[;\n]", asm):
        s = part.strip()
        if s.startswith("{") and s.count("{") > s.count("}"):  # a block opens
            s = s[1:].strip()
        if s.endswith("}") and s.count("}") > s.count("{"):  # a block closes
            s = s[:-1].strip()
        if s and not s.startswith(".reg"):
            out.append(s)
    return out


def run(asm: str, regs: dict) -> dict:
    """Execute `asm` on `regs` (inputs such as ``$4``); returns `regs` with the outputs."""
    regs = dict(regs)

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        return int(tok, 0)

    for line in statements(asm):
        guard = None
        if line.startswith("@"):
            guard, line = line.split(None, 1)
            if not regs[guard[1:]]:
                continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in re.split(r",(?![^{]*})", rest)]
        d = args[0]
        if op == "prmt.b32":
            a, b, sel = val(args[1]), val(args[2]), val(args[3])
            pool = a | (b << 32)
            regs[d] = sum(((pool >> (8 * ((sel >> 4 * i) & 7))) & 0xFF) << 8 * i for i in range(4))
            for i in range(4):  # selector bit 3 of a byte: replicate its sign bit (msb)
                if (sel >> (4 * i + 3)) & 1:
                    byte = (pool >> (8 * ((sel >> 4 * i) & 7))) & 0xFF
                    regs[d] = regs[d] & ~(0xFF << 8 * i) | ((0xFF if byte & 0x80 else 0) << 8 * i)
        elif op == "shl.b32":
            regs[d] = (val(args[1]) << val(args[2])) & M32
        elif op == "shr.b32":
            regs[d] = val(args[1]) >> val(args[2])
        elif op in ("mul.f32", "add.f32"):
            a, b = (torch.tensor([bits_f32(val(x))], dtype=torch.float32) for x in args[1:3])
            regs[d] = f32_bits(float(a * b if op == "mul.f32" else a + b))
        elif op == "and.b32":
            regs[d] = val(args[1]) & val(args[2])
        elif op == "or.b32":
            regs[d] = val(args[1]) | val(args[2])
        elif op in ("mul.rn.f16x2", "mul.rn.bf16x2"):
            dt = torch.float16 if op == "mul.rn.f16x2" else torch.bfloat16
            regs[d] = _lanes_mul(val(args[1]), val(args[2]), dt)
        elif op in ("mov.b32", "mov.f32"):
            src = args[1]
            if src.startswith("{"):  # pack two 16-bit registers, first in the low half
                lo, hi = (val(x) for x in src.strip("{}").split(","))
                regs[d] = (lo & 0xFFFF) | (hi & 0xFFFF) << 16
            else:
                regs[d] = val(src) & M32
        elif op == "cvt.rn.satfinite.e4m3x2.f32":  # d = {cvt(a) in the high byte, cvt(b) low}
            hi = e4m3_satfinite(bits_f32(val(args[1])))
            lo = e4m3_satfinite(bits_f32(val(args[2])))
            regs[d] = hi << 8 | lo
        elif op == "cvt.u32.u16":
            regs[d] = val(args[1]) & 0xFFFF
        elif op in ("cvt.rm.f32.f64", "cvt.rp.f32.f64"):
            regs[d] = _f64_to_f32(bits_f64(val(args[1])), op.split(".")[1])
        elif op == "max.u16x2":
            a, b = val(args[1]), val(args[2])
            regs[d] = max(a & 0xFFFF, b & 0xFFFF) | max(a >> 16, b >> 16) << 16
        elif op == "setp.ne.b32":
            regs[d] = val(args[1]) != val(args[2])
        elif op == "prefetch.global.L2":
            regs.setdefault("prefetched", []).append(val(d.strip("[]")))
        else:
            raise AssertionError(f"PTX model: unknown instruction {op!r} in {line!r}")
    return regs


def _unrotate(byte: int) -> int:
    from fp4_dispatch.backends.sm90 import gemm_w4a16

    return int(gemm_w4a16.unrotate_high_nibbles(torch.tensor([byte])).item())


def assert_every_lane_exact(name: str, asm: str, scales: dict, dtype, prepared: bool) -> None:
    """Run `asm` (inputs ``$4`` = 4 packed bytes, plus `scales`) on 256 words that hold every
    byte value at every position; each 16-bit output lane must be ``e2m1 * 2**-14`` of its
    own byte's nibble (low nibbles in ``$0``/``$1``, high in ``$2``/``$3``; the high nibble
    rotated back first for prepared bytes), in `dtype`."""
    from fp4_dispatch.format.nvfp4 import E2M1_VALUES

    for b0 in range(256):
        b1, b2, b3 = (b0 * 7 + 1) % 256, (b0 * 13 + 5) % 256, 255 - b0
        regs = run(asm, {"$4": b0 | b1 << 8 | b2 << 16 | b3 << 24, **scales})
        outs = {"$0": (0, 1), "$1": (2, 3), "$2": (0, 1), "$3": (2, 3)}
        for reg, (i, j) in outs.items():
            for lane, idx in ((0, i), (1, j)):
                byte = (b0, b1, b2, b3)[idx]
                natural = _unrotate(byte) if prepared else byte
                code = natural & 15 if reg in ("$0", "$1") else natural >> 4
                v = E2M1_VALUES[code & 7] * (-1.0 if code & 8 else 1.0) * 2.0**-14
                bits = (regs[reg] >> 16 * lane) & 0xFFFF
                got = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(dtype).item()
                assert got == v, f"{name}: byte {byte:#04x} {reg} lane {lane}: {got} != {v}"
