"""The precompile worker's entry point: ``python -m fp4_dispatch.autotune.precompile_worker FD``.

Why a module of this package rather than multiprocessing's spawn: spawn re-imports the
parent's main module in every worker, so a user's script without an
``if __name__ == "__main__":`` guard that calls ``tune()`` ran its whole body again in
each worker (on the H200 a benchmark script ran several times at once on the GPU), and a
parent reading its program from standard input had workers that died at start. Started
this way the worker imports only this package; the user's main module is never imported,
whether the parent is a file, ``python -c`` or standard input.

``FD`` is the worker's end of a socket pair (inherited through ``pass_fds``); the job
protocol over it is `fp4_dispatch.autotune.precompile`'s. The parent's ``sys.path`` arrives as
``PYTHONPATH``, so backends pickled by reference import as they did in the parent.
"""

from __future__ import annotations

import logging
import sys
from multiprocessing.connection import Connection

from fp4_dispatch.autotune.precompile import IDLE_EXIT_S, worker_loop

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    """Serve jobs on the inherited socket ``argv[0]`` until told to stop or idle."""
    if len(argv) != 1 or not argv[0].isdigit():
        log.error("usage: python -m fp4_dispatch.autotune.precompile_worker FD (got %r)", argv)
        return 2
    worker_loop(Connection(int(argv[0])), IDLE_EXIT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
