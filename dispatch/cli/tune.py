"""``fp4-dispatch tune --shapes M,N,K ...``: measure each shape's shortlist, keep the winner.

Prints a summary table per shape bucket: the winner and its time, the runner-up, the
heuristic pick (what an untuned call runs) and its regret, the paired check against that
default (median winner / default ratio; "kept" when the default stayed because the
measured winner was not faster beyond the noise band), the measurement policy, and every
tactic that failed (which one, what error). Winners are merged into the tuning cache.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from . import common

if TYPE_CHECKING:
    from ..ranking import Candidate
    from ..tuning import TuneResult


def register(sub: argparse._SubParsersAction) -> None:
    p = common.add_command(
        sub,
        "tune",
        help="measure the shortlist of each shape and cache the winner",
        description="Measure every shortlisted tactic of each shape on this device, keep "
        "the fastest per M bucket (M rounded up to a power of two) and merge the winners "
        "into the tuning cache, which later calls of the same bucket use. Needs the "
        "real device (a simulated one runs nothing); on a CPU it tunes the reference.",
        examples="""fp4-dispatch tune --shapes 1,4096,4096 128x4096x4096
fp4-dispatch tune --shapes 16,8192,8192 --budget 8 --json
fp4-dispatch tune --shapes 1,4096,4096 --force --no-save   # re-measure, keep nothing
fp4-dispatch tune --shapes 1,4096,4096 --op w4a16 --measure eager""",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        required=True,
        type=common.parse_shape,
        metavar="M,N,K",
        help="problem shapes, M,N,K or MxNxK; shapes of one M bucket are tuned once",
    )
    common.add_device_args(p)
    common.add_budget_arg(p, "tactics measured per shape")
    common.add_problem_kind_args(p)
    p.add_argument(
        "--measure",
        default="graph",
        choices=("graph", "eager"),
        help="graph: CUDA-graph replay, cold L2, as graph-captured serving runs (default); "
        "eager: back-to-back launches, launch overhead included. A CPU measures eagerly",
    )
    p.add_argument("--force", action="store_true", help="re-measure buckets already cached")
    p.add_argument("--no-save", action="store_true", help="do not write the tuning cache")
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (or FP4_DISPATCH_PROGRESS=0)"
    )
    common.add_json_arg(p)
    p.set_defaults(func=run)


def _tactic(c: Candidate | None) -> str:
    """``backend 128x64 swap knob=value``: the backend and its tactic's label
    (`fp4_dispatch.tactics.tactic_label`: tile, cluster, swap, knobs off their default)."""
    from ..tactics import tactic_label  # noqa: PLC0415 - lazy: start-up time (--help)

    if c is None:
        return "-"
    lossy = f" [{c.operation}, lossy]" if c.lossy else ""
    return f"{c.backend} {tactic_label(c.tactic)}{lossy}"


def _paired(r: TuneResult) -> str:
    """``0.82`` (adopted at this paired ratio), ``kept 0.99`` (default kept), ``-``."""
    ratio = "" if not math.isfinite(r.paired_ratio) else f"{r.paired_ratio:.3f}"
    if r.kept_default:
        return f"kept {ratio}".strip()
    return ratio or "-"


def render(results: list[TuneResult]) -> str:
    rows = []
    for r in results:
        p = r.problem
        shape = "x".join(str(v) for v in (r.requested or (p.m, p.n, p.k)))
        regret = r.regret
        rows.append(
            (
                shape,
                f"M<={p.m}",
                _tactic(r.winner),
                common.us(r.winner_us),
                _tactic(r.runner_up) if r.source == "measured" else "(cached)",
                common.us(r.runner_up_us),
                _tactic(r.heuristic),
                common.us(r.heuristic_us),
                "-" if not math.isfinite(regret) else f"{regret * 100:+.1f}%",
                _paired(r),
                f"{r.noise_band * 100:.1f}%",
                r.measure,
                len(r.failures),
                r.source if r.source == "cache" else f"{r.wall_s:.2f}s",
            )
        )
    headers = ("shape", "bucket", "winner", "µs", "runner-up", "µs", "heuristic pick", "µs",
               "regret", "vs default", "band", "measure", "failed", "time")  # fmt: skip
    lines = [common.format_table(rows, headers)]
    decided = [r for r in results if r.source == "measured" and r.decision]
    if decided:
        lines += ["", "winner vs default (paired check):"]
        for r in decided:
            p = r.problem
            lines.append(f"  {'x'.join(str(v) for v in (r.requested or (p.m, p.n, p.k)))}: "
                         f"{r.decision}")  # fmt: skip
    failures = [(r, m) for r in results for m in r.failures]
    if failures:
        lines += ["", "failed tactics (timed as infinity):"]
        for r, m in failures:
            p = r.problem
            lines.append(f"  M<={p.m} N={p.n} K={p.k}: {m.candidate.backend} "
                         f"{m.candidate.tactic.canonical_json()}: {m.error}")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    shapes = args.shapes
    groups = common.problem_groups(args)
    d = common.make_dispatcher(args, budget=args.budget)
    if d.device.is_simulated:
        raise common.UsageError(
            f"--device {args.device}: {d.device.name} is simulated; tuning measures kernels "
            "and needs the real device (use explain or compile on a simulated one)"
        )
    results = d.tune(
        shapes,
        out_dtype=args.out_dtype,
        operation=args.op,
        measure=args.measure,
        force=args.force,
        save=not args.no_save,
        progress=False if args.no_progress else None,
        groups=groups,
    )
    path = None if args.no_save or d.cache is None else str(d.cache.path)
    if args.json:
        common.emit_json(
            {"device": common.device_json(d.device), "cache": path,
             "results": [r.to_json() for r in results]}
        )  # fmt: skip
    else:
        where = "not saved" if path is None else f"cache: {path}"
        print(f"device: {d.device.name} ({d.device.kind}); {args.op}, precision "
              f"{d.precision}; budget {args.budget}; "
              f"{where}\n")  # fmt: skip
        print(render(results))
    return 0 if all(r.winner is not None for r in results) else 1
