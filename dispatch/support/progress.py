"""Progress bars for long operations (tuning, compiling many tactics, warm-up, conformance).

One switch for the whole library: ``FP4_DISPATCH_PROGRESS``.

- ``0`` / ``false`` / ``no`` / ``off``: never show a bar;
- ``1`` / ``true`` / ``yes`` / ``on``: always show one (on stderr);
- unset or empty: show one only when stderr is a terminal (tqdm's own rule), so logs
  and CI output stay clean.

An explicit ``enable=`` argument wins over the variable. Bars go to stderr through tqdm;
everything else the library says goes through `logging`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

log = logging.getLogger(__name__)

ENV = "FP4_DISPATCH_PROGRESS"
_OFF = {"0", "false", "no", "off"}
_ON = {"1", "true", "yes", "on"}

T = TypeVar("T")


def enabled(enable: bool | None = None) -> bool | None:
    """True (always), False (never) or None (only on a terminal) for a progress bar."""
    if enable is not None:
        return bool(enable)
    raw = os.environ.get(ENV, "").strip().lower()
    if not raw:
        return None
    if raw in _OFF:
        return False
    if raw in _ON:
        return True
    log.warning("%s=%r is not one of 0/1/true/false/on/off; using the default", ENV, raw)
    return None


def progress(
    iterable: Iterable[T],
    *,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "it",
    enable: bool | None = None,
) -> tqdm:
    """Wrap `iterable` in a progress bar unless progress is turned off (see module).

    Returns the tqdm object (iterate it; ``set_postfix_str`` works, and is a no-op when
    the bar is off).
    """
    on = enabled(enable)
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        leave=False,
        disable=None if on is None else not on,
        dynamic_ncols=True,
    )
