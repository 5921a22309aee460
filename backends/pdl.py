"""Programmatic dependent launch (PDL): the second kernel of a two-launch call starts
while the first is still running.

Why: several calls here are two launches - the activations prepared by a short kernel
(`sm90.expand_rows`, `sm90.gemm_w4a16_rs.dot_order_into`), then the GEMM that reads
them. In a CUDA graph the GEMM otherwise starts only once the first kernel has finished
and its memory is flushed, and then spends its first microseconds waiting for weight
bytes from HBM. With PDL (sm_90+; ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``,
Triton's ``launch_pdl`` option) the GEMM's CTAs are scheduled as soon as every CTA of
the first kernel has executed ``griddepcontrol.launch_dependents``; they fetch what
does not depend on the first kernel (the weights: L2 prefetches or TMA loads into the
ring), then ``griddepcontrol.wait`` until the first kernel's writes are visible.

The contract a kernel launched with PDL keeps: before its `gdc_wait` it reads nothing
the kernel before it on the stream writes, and writes nothing that kernel reads. Only
the second kernel of one of our own calls is launched with PDL, so "the kernel before
it" is always our own first kernel (which writes one kept buffer): everything launched
earlier on the stream has completed, as for any launch, because the first kernel was
launched without PDL.

Both instructions are no-ops in a kernel launched without the attribute, so a kernel
compiled with them stays correct when launched normally. Triton's interpreter has no
grid dependency control: kernels take a ``PDL`` constexpr, `ENABLED` off there.
``FP4_DISPATCH_PDL=0`` turns it off everywhere (read once at import: an A/B switch).
"""

from __future__ import annotations

import logging
import os

import triton
import triton.language as tl

log = logging.getLogger(__name__)

__all__ = ["ENABLED", "gdc_launch_dependents", "gdc_wait", "launch_options"]

try:  # Triton >= 3.4: triton.language.extra.cuda.gdc_wait / gdc_launch_dependents
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: kernels compile with PDL=False and never call these

    @triton.jit
    def gdc_wait():
        """Stand-in where this Triton has no grid dependency control (never called)."""
        tl.static_assert(False, "grid dependency control needs Triton >= 3.4")

    @triton.jit
    def gdc_launch_dependents():
        """Stand-in where this Triton has no grid dependency control (never called)."""
        tl.static_assert(False, "grid dependency control needs Triton >= 3.4")

    _HAVE_GDC = False
else:
    _HAVE_GDC = True


def _enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
        return False
    if os.environ.get("FP4_DISPATCH_PDL", "1") == "0":
        log.info("FP4_DISPATCH_PDL=0: programmatic dependent launch off")
        return False
    return _HAVE_GDC


#: whether kernels compile the grid dependency instructions and the second kernel of a
#: call launches with PDL
ENABLED: bool = _enabled()


def launch_options(pdl: bool) -> dict[str, object]:
    """The launch options of a kernel that may be the second of a call: Triton's
    ``launch_pdl`` when `pdl` and `ENABLED`, else none (an ordinary launch)."""
    return {"launch_pdl": True} if pdl and ENABLED else {}
