"""Every piece of inline PTX in the kernels runs in CPU CI, through the PTX model.

`test_every_inline_ptx_block_has_a_check` finds each PTX block of every module under
``fp4_dispatch.backends`` (module-level strings that name an operand ``$0``, and string
literals handed to ``inline_asm_elementwise``) and requires a check for its exact text
(`CHECKS`): a new or edited block without one fails here. Each check runs the block on
the CPU model (`tests/ptx_model.py`) against the format's definition, and
`test_one_bit_changes_are_caught` makes every one-bit change to a block's immediates (and
the operand swaps that matter) and asserts that its check then fails.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import math
import pkgutil
import random
import re
from collections.abc import Callable
from importlib import resources

import ptx_model
import pytest
import torch
from ptx_model import bits_f32, f32_bits, f64_bits

triton = pytest.importorskip("triton")

ONES_F16 = 0x3C00 | 0x3C00 << 16  # scale 1.0 in both fp16 lanes
ONES_BF16 = 0x7780 | 0x7780 << 16  # bf16 dequantizers carry 2**112 in the scale


def _text(asm: object) -> str:
    asm = getattr(asm, "value", asm)  # tl.constexpr / gl.constexpr
    return " ; ".join(ptx_model.statements(str(asm)))


# ---- the checks ------------------------------------------------------------------------


def _lanes(dtype, prepared, scales=None) -> Callable[[str], None]:
    def check(asm: str) -> None:
        regs = {} if scales is None else {"$5": scales, "$6": scales}
        ptx_model.assert_every_lane_exact("block", asm, regs, dtype, prepared)

    return check


def _e4m3_inputs() -> list[float]:
    """Every e4m3 value in [0, 448], the midpoints between neighbours (ties to even), the
    floats next to them, and random values."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    out = list(values)
    for a, b in itertools.pairwise(values):
        mid = (a + b) / 2
        out += [mid, math.nextafter(mid, 0), math.nextafter(mid, 1000)]
    rng = random.Random(7)
    out += [rng.uniform(0, 448) for _ in range(500)] + [rng.uniform(0, 0.02) for _ in range(200)]
    return [bits_f32(f32_bits(v)) for v in out if v <= 448]


def check_e4m3(asm: str) -> None:
    """``cvt.rn.satfinite`` of a non-negative float32 <= 448 into the low byte of $0."""
    for v in _e4m3_inputs():
        got = ptx_model.run(asm, {"$1": f32_bits(v)})["$0"]
        want = ptx_model.e4m3_satfinite(v)
        assert got == want, f"e4m3 of {v!r}: {got:#x} != {want:#x}"


def _f64_inputs() -> list[float]:
    rng = random.Random(3)
    out = []
    for _ in range(300):
        f = bits_f32(f32_bits(rng.uniform(1e-6, 1e4)))
        out += [f, math.nextafter(f, 0), math.nextafter(f, math.inf),
                (f + math.nextafter(f, math.inf)) / 2]  # fmt: skip
    return out


def check_round_down(asm: str) -> None:
    """$0: the largest float32 <= the float64 $1."""
    for b in _f64_inputs():
        f = bits_f32(ptx_model.run(asm, {"$1": f64_bits(b)})["$0"])
        assert f <= b < bits_f32(f32_bits(f) + 1), (b, f)


def check_round_up(asm: str) -> None:
    """$0: the smallest float32 >= the float64 $1."""
    for b in _f64_inputs():
        f = bits_f32(ptx_model.run(asm, {"$1": f64_bits(b)})["$0"])
        assert bits_f32(f32_bits(f) - 1) < b <= f, (b, f)


def check_pair_word(asm: str) -> None:
    """$0 = $1 | $2 << 16 (two 16-bit registers as one word, the first low)."""
    rng = random.Random(1)
    for _ in range(200):
        lo, hi = rng.randrange(1 << 16), rng.randrange(1 << 16)
        assert ptx_model.run(asm, {"$1": lo, "$2": hi})["$0"] == lo | hi << 16


def check_max_u16x2(asm: str) -> None:
    rng = random.Random(2)
    for _ in range(300):
        x, y = rng.randrange(1 << 32), rng.randrange(1 << 32)
        want = max(x & 0xFFFF, y & 0xFFFF) | max(x >> 16, y >> 16) << 16
        assert ptx_model.run(asm, {"$1": x, "$2": y})["$0"] == want


def check_lane_mask(asm: str) -> None:
    """Each 16-bit lane -> 0xFFFF where its top bit is set (`_lane_mask`'s integer twin)."""
    edges = [0, 0x8000, 0x80000000, 0x80008000, 0x7FFF7FFF, 0x12348765]
    for d in [*edges, *range(0, 1 << 32, 0x01010101 * 7)]:
        assert ptx_model.run(asm, {"$1": d})["$0"] == ((d >> 15) & 0x10001) * 0xFFFF, hex(d)


def check_prefetch(asm: str) -> None:
    """Prefetches address $1 exactly when $2 != 0; $0 is 0."""
    for addr, mask in ((0x7F0000001000, 1), (0x7F0000002000, 0), (0x10, 5)):
        regs = ptx_model.run(asm, {"$1": addr, "$2": mask})
        assert regs["$0"] == 0 and regs.get("prefetched", []) == ([addr] if mask else [])


PREFETCH = "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }"


def _bf16_bits(v: float) -> int:
    return int(torch.tensor([v]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _pair_inputs() -> list[int]:
    """bf16 bits of ``v * 2**-14``: every product the W4A8 weight pass forms (each e2m1
    value times each e4m3 block scale times a channel factor ``2**k``, within E4M3's
    range, ties to even among them), then random bf16 values of that range."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    scales = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    out = []
    for k in range(-3, 4):
        for c in e2m1:
            for sc in scales:
                v = c * sc * 2.0**k
                if v <= 448:
                    out += [_bf16_bits(v * 2.0**-14), _bf16_bits(-v * 2.0**-14)]
    rng = random.Random(5)
    out += [_bf16_bits(rng.uniform(-448, 448) * 2.0**-14) for _ in range(2000)]
    return out


def check_pair_e4m3(asm: str) -> None:
    """$1, $2: two bf16 lanes each (even K, odd K) of ``v * 2**-14`` -> $0: the E4M3 codes
    of the four ``v`` in memory order (lane 0 even, lane 0 odd, lane 1 even, lane 1 odd),
    round to nearest even (`gemm_w4a8._PAIR_E4M3_ASM`)."""
    vals = _pair_inputs()
    rng = random.Random(6)
    rng.shuffle(vals)
    for i in range(0, len(vals) - 3, 4):
        e0, o0, e1, o1 = vals[i : i + 4]
        got = ptx_model.run(asm, {"$1": e0 | e1 << 16, "$2": o0 | o1 << 16})["$0"]
        want = 0
        for j, b in enumerate((e0, o0, e1, o1)):
            v = torch.tensor([b], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
            want |= ptx_model.e4m3_satfinite(float(v) * 2.0**14) << 8 * j
        assert got == want, (hex(e0), hex(o0), hex(e1), hex(o1), hex(got), hex(want))


_E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _table_inputs() -> list[float]:
    """``s / sw`` of the W4A8 rs kernel's tables: every positive e4m3 block scale ``s``
    over the channel scale of a row whose largest block scale is ``s``, 2**4 or 2**12
    times it (`reference.w4a8.weight_exponents`: E4M3 subnormals and flushes included)."""
    from fp4_dispatch.backends.reference import w4a8 as ref

    scales = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    out = []
    for row_max in (1, 2**4, 2**12):
        ew = ref.pow2_exponent(ref.E2M1_MAX * scales * row_max)
        out += (scales * ref.pow2(-ew)).tolist()
    return out


def check_e4m3_table(asm: str) -> None:
    """$2 = ``f`` (fp32) -> $0, $1: the E4M3 codes of ``{0, .5, 1, 1.5}`` and ``{2, 3, 4,
    6}`` times ``f``, a byte each, low byte first (`gemm_w4a8_rs._TABLE_ASM`)."""
    for f in _table_inputs():
        regs = ptx_model.run(asm, {"$2": f32_bits(f)})
        got = regs["$0"] | regs["$1"] << 32
        want = sum(ptx_model.e4m3_satfinite(m * f) << 8 * i for i, m in enumerate(_E2M1_MAGS))
        assert got == want, (f, hex(got), hex(want))


def _lookup_inputs() -> list[dict]:
    """Words of 8 nibbles (every code at every place: 16 rotations of 0x76543210 and
    0xFEDCBA98 mixes, then random words) with tables of 8 random magnitude codes (< 0x7F),
    the table registers repeated as Triton passes them (``pack=4``)."""
    rng = random.Random(11)
    words = [0x76543210, 0xFEDCBA98, 0x8F7E6D5C, 0xC4B3A291]
    words += [(w << 4 * r | w >> 32 - 4 * r) & 0xFFFFFFFF for w in words for r in range(1, 8)]
    words += [rng.randrange(1 << 32) for _ in range(300)]
    out = []
    for w in words:
        table = [rng.randrange(0x7F) for _ in range(8)]
        lo = sum(b << 8 * i for i, b in enumerate(table[:4]))
        hi = sum(b << 8 * i for i, b in enumerate(table[4:]))
        regs = {"$2": w} | {f"${i}": lo for i in range(3, 7)}
        out.append(regs | {f"${i}": hi for i in range(7, 11)})
    return out


def check_e4m3_lookup(asm: str) -> None:
    """$2: 8 nibbles (e2m1 codes, low first), $3/$7: the table's bytes 0-3/4-7 -> $0 the
    codes of nibbles 0-3, $1 of 4-7: ``table[n & 7] | (n & 8) << 4`` a byte each
    (`gemm_w4a8_rs._EXPAND_ASM`)."""
    for regs in _lookup_inputs():
        got = ptx_model.run(asm, regs)
        table = regs["$3"] | regs["$7"] << 32
        nib = [(regs["$2"] >> 4 * j) & 0xF for j in range(8)]
        codes = [(table >> 8 * (n & 7)) & 0xFF | (n & 8) << 4 for n in nib]
        want = [sum(c << 8 * i for i, c in enumerate(codes[h * 4 : h * 4 + 4])) for h in (0, 1)]
        assert [got["$0"], got["$1"]] == want, (hex(regs["$2"]), got["$0"], got["$1"], want)


def _checks() -> dict[str, Callable[[str], None]]:
    """Exact block text -> its check. Module constants are taken from the modules (the
    check runs what ships); literal blocks are spelled here (an edit makes them unknown)."""
    from fp4_dispatch.backends import quantize
    from fp4_dispatch.backends.sm90 import (
        gemm_direct,
        gemm_w4a8,
        gemm_w4a8_rs,
        gemm_w4a16,
        gemm_w4a16_decode,
    )

    w = gemm_w4a16
    return {
        _text(gemm_direct._E2M1X4_TO_F16_ASM): _lanes(torch.float16, False),
        _text(w._F16_NATURAL): _lanes(torch.float16, False, ONES_F16),
        _text(w._F16_PREPARED): _lanes(torch.float16, True, ONES_F16),
        _text(w._BF16_NATURAL): _lanes(torch.bfloat16, False, ONES_BF16),
        _text(w._BF16_PREPARED): _lanes(torch.bfloat16, True, ONES_BF16),
        _text(gemm_w4a16_decode._NATURAL): _lanes(torch.float16, False),
        _text(gemm_w4a16_decode._PREPARED): _lanes(torch.float16, True),
        _text(quantize._E4M3_ASM): check_e4m3,
        _text("cvt.rm.f32.f64 $0, $1;"): check_round_down,
        _text("cvt.rp.f32.f64 $0, $1;"): check_round_up,
        _text("mov.b32 $0, {$1, $2};"): check_pair_word,
        _text("max.u16x2 $0, $1, $2;"): check_max_u16x2,
        _text("prmt.b32 $0, $1, 0, 0xBB99;"): check_lane_mask,
        _text(PREFETCH): check_prefetch,
        _text(gemm_w4a8._PAIR_E4M3_ASM): check_pair_e4m3,
        _text(gemm_w4a8_rs._TABLE_ASM): check_e4m3_table,
        _text(gemm_w4a8_rs._EXPAND_ASM): check_e4m3_lookup,
    }


# ---- finding every block -----------------------------------------------------------------


def _modules_with_asm() -> list[str]:
    """Modules under fp4_dispatch.backends whose source calls ``inline_asm_elementwise``."""
    import fp4_dispatch.backends as pkg

    found = []
    for info in pkgutil.walk_packages(pkg.__path__, "fp4_dispatch.backends."):
        if info.ispkg:
            source = resources.files(info.name).joinpath("__init__.py").read_text()
        else:
            parent, _, leaf = info.name.rpartition(".")
            source = resources.files(parent).joinpath(f"{leaf}.py").read_text()
        if "inline_asm_elementwise" in source:
            found.append((info.name, source))
    return found


def _blocks() -> dict[str, str]:
    """Every PTX block: text -> where it is (module and name or line)."""
    blocks: dict[str, str] = {}
    for name, source in _modules_with_asm():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            value = getattr(value, "value", value)
            if isinstance(value, str) and re.search(r"\$0\b", value):
                blocks.setdefault(_text(value), f"{name}.{attr}")
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") ==
                    "inline_asm_elementwise" and node.args):  # fmt: skip
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    blocks.setdefault(_text(arg.value), f"{name}:{node.lineno}")
    return blocks


def test_every_inline_ptx_block_has_a_check():
    blocks, checks = _blocks(), _checks()
    unchecked = {where: text for text, where in blocks.items() if text not in checks}
    assert not unchecked, f"inline PTX without a CPU check (add one to CHECKS): {unchecked}"
    assert len(blocks) >= 15, sorted(blocks.values())  # the blocks this file knows of


@pytest.mark.parametrize("index", range(17))
def test_each_block_matches_its_definition(index):
    text, check = list(_checks().items())[index]
    check(text)


# ---- mutations ---------------------------------------------------------------------------


def _mutants(text: str) -> list[tuple[str, str]]:
    """(description, mutated text): each set bit of each immediate cleared, bit 0 of each
    shift amount flipped, and the two sources swapped where order matters."""
    out = []
    for m in re.finditer(r"(?<![\w$])(0x[0-9A-Fa-f]+|\d+)(?![\w.])", text):
        value = int(m.group(1), 0)
        bits = [1 << i for i in range(32) if value >> i & 1] or [1]
        for bit in bits:
            new = value ^ bit
            token = hex(new) if m.group(1).startswith("0x") else str(new)
            out.append((f"{m.group(1)} -> {token} at {m.start()}",
                        text[: m.start()] + token + text[m.end() :]))  # fmt: skip
    for m in re.finditer(
        r"(cvt\.rn\.satfinite\.e4m3x2\.f32|prmt\.b32) ([^,\s]+), ([^,\s]+), ([^,\s]+)", text
    ):
        swapped = f"{m.group(1)} {m.group(2)}, {m.group(4)}, {m.group(3)}"
        out.append((f"swap in {m.group(0)}", text[: m.start()] + swapped + text[m.end() :]))
    return out


def _mutated_blocks() -> list[tuple[str, list[dict]]]:
    """(block, inputs on which two blocks are compared): every byte value at every position
    for the dequantizers (each output lane depends on its own byte only), the e4m3 inputs
    for the conversion."""
    from fp4_dispatch.backends import quantize
    from fp4_dispatch.backends.sm90 import gemm_direct, gemm_w4a8, gemm_w4a8_rs, gemm_w4a16_decode

    words = [{"$4": b | ((b * 7 + 1) % 256) << 8 | ((b * 13 + 5) % 256) << 16 | (255 - b) << 24}
             for b in range(256)]  # fmt: skip
    floats = [{"$1": f32_bits(v)} for v in _e4m3_inputs()]
    v = _pair_inputs()[::7]
    pairs = [{"$1": v[i] | v[i + 1] << 16, "$2": v[i + 2] | v[i + 3] << 16}
             for i in range(len(v) - 3)]  # fmt: skip
    return [(_text(gemm_direct._E2M1X4_TO_F16_ASM), words), (_text(quantize._E4M3_ASM), floats),
            (_text(gemm_w4a16_decode._NATURAL), words),
            (_text(gemm_w4a8._PAIR_E4M3_ASM), pairs),
            (_text(gemm_w4a8_rs._TABLE_ASM), [{"$2": f32_bits(f)} for f in _table_inputs()]),
            (_text(gemm_w4a8_rs._EXPAND_ASM), _lookup_inputs())]  # fmt: skip


def _outputs(text: str, inputs: list[dict]) -> list[tuple]:
    outs = []
    for regs in inputs:
        got = ptx_model.run(text, regs)
        outs.append(tuple(got.get(f"${i}") for i in range(4)))
    return outs


@pytest.mark.parametrize("index", range(6))
def test_one_bit_changes_are_caught(index):
    """The W4A4 direct dequantizer, the quantizer's e4m3 conversion (operand swap
    included), an unscaled W4A16 dequantizer, the W4A8 weight pass's paired conversion
    (its swaps too) and the W4A8 rs kernel's table and lookup: every one-bit mutant
    either fails its check or is equivalent (the same output bits on every input that
    covers the block: e.g. a selector bit that only picks which zero byte fills a
    masked-off position)."""
    text, inputs = _mutated_blocks()[index]
    check = _checks()[text]
    original = _outputs(text, inputs)
    mutants = _mutants(text)
    caught, equivalent, survivors = 0, 0, []
    for what, mutant in mutants:
        try:
            check(mutant)
        except (AssertionError, KeyError, ValueError):
            caught += 1
            continue
        if _outputs(mutant, inputs) == original:
            equivalent += 1
        else:
            survivors.append(what)
    assert not survivors, survivors
    assert caught >= len(mutants) // 2 and caught + equivalent == len(mutants)
