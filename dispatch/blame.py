"""Whose fault is a failed kernel call: the caller's arguments, or the plugin's code.

Why: a kernel that raises used to mark its (backend, tactic) broken for the process. When
the cause was the caller's argument (an ``out`` the kernel cannot write, a misaligned
view), one bad call disabled the backend for every later caller of that dispatcher - on
the shared default dispatcher, every ``Nvfp4Linear`` in the process.

So a failure is re-run, before anything is recorded, on known-good arguments: fresh
contiguous, detached copies of every tensor (a new output included). If the kernel then
runs, the failure is the caller's: `ArgumentError` names the argument (the one whose
fresh copy alone makes the call work, when there is one), and nothing is recorded
against the backend. If it fails again, the plugin's code is at fault and the caller
falls back as before. This costs nothing on the hot path: it runs only after a kernel
has raised.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .plans import Plan

log = logging.getLogger(__name__)

#: what each position of a plan's arguments is called in the public API (`Plan`,
#: `DensePlan`): names an `ArgumentError` uses
ARG_NAMES: dict[str, tuple[str, ...]] = {
    "w4a4": ("qa.data", "qa.scale", "qb.data", "qb.scale", "alpha", "out", "qb.global_scale"),
    "w4a16": ("qa", "qb.data", "qb.scale", "alpha", "out", "bias", "b_prepared"),
    "grouped_w4a16": ("a", "b.data", "b.scale", "b.global_scale", "offsets", "out"),
    "grouped_w4a4": ("a.data", "a.scale", "b.data", "b.scale", "alpha", "offsets", "out"),
}


class ArgumentError(ValueError):
    """A kernel failed on the caller's arguments and runs on fresh copies of them: the
    caller's fault. Nothing was recorded against the backend; ``argument`` names the
    argument to blame (None: the combination)."""

    def __init__(self, message: str, argument: str | None) -> None:
        super().__init__(message)
        self.argument = argument


def _fresh(t: object) -> object:
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().clone(memory_format=torch.contiguous_format)


def _runs(plan: Plan, args: tuple) -> bool:
    """Whether the plan's kernel completes on `args` (any exception but Ctrl-C: no)."""
    try:
        with torch.no_grad():
            plan(*args)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # plugin code: a repeat failure is the plugin's
        log.debug("re-run of %r failed too: %r", plan, exc)
        return False
    return True


def callers_fault(plan: Plan, args: tuple, exc: BaseException) -> ArgumentError | None:
    """`ArgumentError` when `plan` fails on `args` but runs on fresh copies, else None."""
    fresh = tuple(_fresh(t) for t in args)
    if not _runs(plan, fresh):
        return None
    names = ARG_NAMES.get(plan.key[4], ())
    culprit = None
    for i, t in enumerate(args):  # which argument alone, replaced, makes it work?
        if isinstance(t, torch.Tensor) and _runs(plan, (*args[:i], fresh[i], *args[i + 1 :])):
            culprit = names[i] if i < len(names) else f"argument {i}"
            break
    backend, tactic = plan.candidate.backend, plan.candidate.tactic.canonical_json()
    what = culprit or "the arguments"
    detail = _describe(args[names.index(culprit)]) if culprit in names else ""
    return ArgumentError(
        f"{what}: backend {backend} tactic {tactic} failed on it ({type(exc).__name__}: "
        f"{exc}) but runs on a fresh copy{detail}; the argument is at fault, not the "
        "backend (nothing was disabled)",
        culprit,
    )


def _describe(t: object) -> str:
    """What is unusual about a tensor argument, for the message."""
    if not isinstance(t, torch.Tensor):
        return ""
    facts = [f"{t.dtype}", f"shape {tuple(t.shape)}", f"strides {t.stride()}"]
    if t.storage_offset():
        facts.append(f"storage offset {t.storage_offset()}")
    if t.requires_grad:
        facts.append("requires grad")
    if t.is_inference():
        facts.append("an inference tensor")
    return f" (it is {', '.join(facts)})"
