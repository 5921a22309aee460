"""The conformance checks: load, contract, tactics, JSON, validity, dispatcher, numerics.

What `fp4_dispatch.testing.check_plugin` / `check_backend` run (the categories are listed
in that module's docstring, which is the user-facing description); each check adds a
`fp4_dispatch.conformance_report.Check` to the report and never raises for a plugin's
fault. Numerics use the harness (`fp4_dispatch.harness.random_operands` and `compare`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import typing
from collections.abc import Sequence
from importlib import metadata
from typing import Any, Literal

import torch

from . import harness, registry
from .backend import Backend, DenseOperands, GemmOperands, Support, kernel_problem
from .candidates import Candidate
from .conformance_report import ConformanceReport, Status
from .device import DeviceInfo
from .dispatcher import Dispatcher
from .guard import launch
from .profiles import profiles, resolve
from .progress import progress
from .tactics import DENSE_OPERATIONS, GROUPED_OPERATIONS, Problem, Tactic, is_lossy

log = logging.getLogger(__name__)

#: decode M=1, a ragged M with float16 output, M across two 128-row scale tiles with
#: ragged N and K not a multiple of 64, and a square-ish prefill shape
#: the expert count of the grouped problems made for a backend that serves a grouped
#: operation (`_for_operations`): a few experts, some left empty by the random routing
CONFORMANCE_GROUPS = 4
DEFAULT_PROBLEMS: tuple[Problem, ...] = (
    Problem(m=1, n=256, k=256),
    Problem(m=37, n=96, k=128, out_dtype="float16"),
    Problem(m=130, n=200, k=320),
    Problem(m=256, n=128, k=512),
)
DEFAULT_TOLERANCE = 1e-2  # relative Frobenius error; 16-bit output rounding is ~4e-3


def _tolerance_for(operation: str, tolerance: float) -> float:
    """`tolerance`, widened to the tuner's lossy bound for a lossy operation (W4A8 rounds
    both operands to FP8: ~3% against the exact product, `harness.CHECK_RTOL_LOSSY`)."""
    return max(tolerance, harness.CHECK_RTOL_LOSSY) if is_lossy(operation) else tolerance


_SHOW = 3  # offending items quoted per check


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _quote(items: Sequence[str]) -> str:
    more = f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
    return "; ".join(items[:_SHOW]) + more


def _json_of(t: Any) -> str:
    try:
        return t.canonical_json()
    except Exception as exc:  # quoting a broken tactic must not hide the real failure
        return f"<{type(t).__name__}: canonical_json raised {_err(exc)}>"


# ---- the backend object ---------------------------------------------------------------------


def _check_definition(report: ConformanceReport, b: Backend) -> bool:
    """Attributes, tactic model and diversity axes. False when nothing else can be checked."""
    name = getattr(b, "name", type(b).__name__)
    try:
        registry.check_backend(b)
    except TypeError as exc:
        report.add("backend", "contract", "FAIL", str(exc), str(name))
        return False
    report.add("backend", "contract", "PASS", f"{b.family} {b.version}", b.name)
    ttype = b.tactic_type
    cfg = ttype.model_config
    problems = []
    if cfg.get("frozen") is not True:
        problems.append("model_config must set frozen=True (tactics are hashed and cached)")
    if cfg.get("extra") != "forbid":
        problems.append('model_config must set extra="forbid" (typos must be errors)')
    fld = ttype.model_fields.get("backend")
    args = typing.get_args(fld.annotation) if fld is not None else ()
    if fld is None or typing.get_origin(fld.annotation) is not Literal or args != (b.name,):
        got = None if fld is None else fld.annotation
        problems.append(f"field 'backend' must be Literal[{b.name!r}] (got {got})")
    missing = [a for a in b.diversity_axes if a not in ttype.model_fields]
    if missing:
        problems.append(f"diversity_axes {missing} are not fields of {ttype.__name__}")
    status: Status = "FAIL" if problems else "PASS"
    report.add("backend", "tactic-model", status, _quote(problems) or ttype.__name__, b.name)
    return True


def _supports(report: ConformanceReport, b: Backend, device: DeviceInfo) -> Support | None:
    try:
        support = b.supports(device)
    except Exception as exc:  # recorded as a failure of the plugin
        report.add("backend", "supports", "FAIL", f"supports() raised {_err(exc)}", b.name)
        return None
    if not isinstance(support, Support) or not isinstance(support.reason, str):
        report.add(
            "backend",
            "supports",
            "FAIL",
            f"supports() must return Support(ok, reason), got {support!r}",
            b.name,
        )
        return None
    word = "supported" if support.ok else "not supported"
    report.add("backend", "supports", "PASS", f"{word}: {support.reason}", b.name)
    return support


def _tactics_for(
    report: ConformanceReport, b: Backend, problem: Problem, device: DeviceInfo
) -> list[Tactic] | None:
    """tactics() checked for type, name, re-validation, hashing and determinism."""
    label = f"M={problem.m} N={problem.n} K={problem.k} {problem.out_dtype}"
    try:
        got = list(b.tactics(problem, device))
        again = list(b.tactics(problem, device))
    except Exception as exc:  # recorded as a failure of the plugin
        report.add("tactics", label, "FAIL", f"tactics() raised {_err(exc)}", b.name)
        return None
    bad: list[str] = []
    good: list[Tactic] = []
    for t in got:
        why = _tactic_problem(b, t)
        if why:
            bad.append(f"{_json_of(t)}: {why}")
        else:
            good.append(t)
    if bad:
        report.add("tactics", label, "FAIL", f"{len(bad)} invalid: {_quote(bad)}", b.name)
        return good
    if set(got) != set(again):
        report.add(
            "tactics",
            label,
            "FAIL",
            "two calls gave different tactic sets (ranking must be reproducible)",
            b.name,
        )
        return good
    report.add("tactics", label, "PASS", f"{len(good)} tactics", b.name)
    return good


def _tactic_problem(b: Backend, t: Any) -> str:
    """Why `t` is not a proper tactic of `b` ('' when it is)."""
    if not isinstance(t, b.tactic_type):
        return f"is a {type(t).__name__}, expected {b.tactic_type.__name__}"
    if t.backend != b.name:
        return f"backend is {t.backend!r}, expected {b.name!r}"
    try:
        again = b.tactic_type.model_validate(t.model_dump())
    except Exception as exc:  # a model_construct'ed value that does not validate
        return f"fails re-validation: {_err(exc).splitlines()[0]}"
    if again != t:
        return "re-validation changes its value"
    try:
        hash(t)
    except TypeError as exc:
        return f"unhashable: {exc}"
    return ""


def _check_estimates(
    report: ConformanceReport, b: Backend, pairs: list[tuple[Problem, Tactic]], device: DeviceInfo
) -> None:
    if type(b).estimate_us is Backend.estimate_us or not pairs:
        return
    bad = []
    for problem, t in pairs:
        try:
            v = b.estimate_us(problem, device, t)
        except Exception as exc:  # the ranker tolerates it with a warning; authors should not
            bad.append(f"{_json_of(t)}: raised {_err(exc)}")
            continue
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            bad.append(f"{_json_of(t)}: returned {v!r}")
    status: Status = "FAIL" if bad else "PASS"
    msg = _quote(bad) or f"{len(pairs)} estimates, each None or finite >= 0"
    report.add("tactics", "estimate_us", status, msg, b.name)


def _check_json(report: ConformanceReport, b: Backend, tactics: list[Tactic]) -> None:
    bad = []
    ttype = b.tactic_type
    for t in tactics:
        try:
            via_json = ttype.model_validate_json(t.model_dump_json())
            via_dict = ttype.model_validate(json.loads(json.dumps(t.model_dump(mode="json"))))
            canon = t.canonical_json()
            same_canon = ttype.model_validate(json.loads(canon)).canonical_json() == canon
        except Exception as exc:  # recorded as a failure of the plugin
            bad.append(f"{_json_of(t)}: {_err(exc).splitlines()[0]}")
            continue
        if via_json != t or via_dict != t:
            got = via_json if via_json != t else via_dict
            bad.append(f"{_json_of(t)} came back as {_json_of(got)}")
        elif not same_canon:
            bad.append(f"{_json_of(t)}: canonical JSON not stable")
    if bad:
        msg = f"{len(bad)} of {len(tactics)} do not round-trip: {_quote(bad)}"
        report.add("json", "round-trip", "FAIL", msg, b.name)
    else:
        report.add("json", "round-trip", "PASS", f"{len(tactics)} tactics round-trip", b.name)


def _check_validity(
    report: ConformanceReport, b: Backend, pairs: list[tuple[Problem, Tactic]], device: DeviceInfo
) -> None:
    bad = []
    for problem, t in pairs:
        try:
            why = b.validate(t, problem, device)
        except Exception as exc:  # recorded as a failure of the plugin
            why = f"validate() raised {_err(exc)}"
        if why is not None:
            bad.append(f"{_json_of(t)} for M={problem.m} N={problem.n} K={problem.k}: {why}")
    status: Status = "FAIL" if bad else "PASS"
    msg = (
        f"{len(bad)} offered tactics rejected by validate(): {_quote(bad)}"
        if bad
        else f"validate() accepts all {len(pairs)} offered (problem, tactic) pairs"
    )
    report.add("validity", "validate", status, msg, b.name)


def _sample(tactics: list[Tactic], samples: int, rng: random.Random) -> list[Tactic]:
    """`samples` tactics, deterministic, covering both orientations when offered."""
    ordered = sorted(tactics, key=lambda t: t.canonical_json())
    picked: list[Tactic] = []
    for swap in (False, True):
        first = next((t for t in ordered if t.swap_ab is swap), None)
        if first is not None and len(picked) < samples:
            picked.append(first)
    rest = [t for t in ordered if t not in picked]
    picked += rng.sample(rest, min(len(rest), max(0, samples - len(picked))))
    return picked


def _for_operations(problems: Sequence[Problem], backend: object) -> tuple[Problem, ...]:
    """Each problem once per operation the backend serves (a problem that names an
    operation the backend does not serve is asked in the backend's own operations)."""
    ops = tuple(getattr(backend, "operations", ("w4a4",)) or ("w4a4",))
    out: list[Problem] = []
    for p in problems:
        wanted = [p.operation] if p.operation in ops else list(ops)
        for op in wanted:
            # a grouped operation over `CONFORMANCE_GROUPS` experts unless `p` names E
            groups = (p.groups or CONFORMANCE_GROUPS) if op in GROUPED_OPERATIONS else None
            q = p if p.operation == op else p.model_copy(update={"operation": op,
                                                                 "groups": groups})  # fmt: skip
            if q not in out:
                out.append(q)
    return tuple(out)


def _run_one(
    b: Backend, problem: Problem, t: Tactic, device: DeviceInfo, seed: int, tolerance: float
) -> tuple[Status, str, str]:
    """(status, message, category) for building and, if possible, running one tactic."""
    try:
        kernel = b.build(t, kernel_problem(problem, t), device)
    except Exception as exc:  # recorded as a failure of the plugin
        return "FAIL", f"build() raised {_err(exc)}", "build"
    if not callable(kernel):
        return "FAIL", f"build() returned a non-callable {type(kernel).__name__}", "build"
    if device.is_simulated:
        return "PASS", "built (simulated device: not run)", "build"
    tdev = torch.device(device.torch_device)
    ops, ref = harness.random_operands(problem, tdev, seed)
    dtype = harness.OUT_DTYPES[problem.out_dtype]
    out = torch.full((problem.m, problem.n), float("nan"), dtype=dtype, device=tdev)
    try:
        if isinstance(ops, DenseOperands):  # W4A16 kernels are never swapped
            kernel(ops, out)
        else:
            launch(kernel, ops, out, t.swap_ab)
        if tdev.type == "cuda":
            torch.cuda.synchronize(tdev)
    except Exception as exc:  # recorded as a failure of the plugin
        return "FAIL", f"kernel raised {_err(exc)}", "numerics"
    tolerance = _tolerance_for(problem.operation, tolerance)
    err, why = harness.compare(out, ref, tolerance)
    if why:
        return "FAIL", why, "numerics"
    try:
        why = _check_declared_extras(kernel, ops, ref, out, t, tolerance)
    except Exception as exc:  # recorded as a failure of the plugin
        why = f"kernel raised {_err(exc)} with its declared extras"
    if why:
        return "FAIL", why, "numerics"
    return "PASS", f"relative error {err:.2e}", "numerics"


def _check_declared_extras(
    kernel: Any, ops: Any, ref: torch.Tensor, out: torch.Tensor, t: Tactic, tolerance: float
) -> str | None:
    """What a kernel class declares beyond the basic contract, run and compared: alpha as
    two factors (``alpha_factors``, `GemmOperands.alpha_b`) and a bias epilogue
    (``bias_epilogue``, `DenseOperands.bias`). The dispatcher hands these only to kernels
    that declare them, so a wrong declaration would give wrong results in serving."""
    cls = type(kernel)
    if getattr(cls, "alpha_factors", False) is True and isinstance(ops, GemmOperands):
        # alpha * 2 and 0.5: the same product, exactly, split over the two factors
        half = torch.full_like(ops.alpha, 0.5)
        split = dataclasses.replace(ops, alpha=ops.alpha * 2, alpha_b=half)
        out.fill_(float("nan"))
        launch(kernel, split, out, t.swap_ab)
        _, why = harness.compare(out, ref, tolerance)
        if why:
            return f"alpha_factors (alpha given as two factors): {why}"
    if getattr(cls, "bias_epilogue", False) is True and isinstance(ops, DenseOperands):
        gen = torch.Generator().manual_seed(ops.n)
        bias = (torch.randn(ops.n, generator=gen, dtype=torch.float64) * ref.std()).to(out.dtype)
        bias = bias.to(out.device)
        out.fill_(float("nan"))
        kernel(dataclasses.replace(ops, bias=bias), out)
        _, why = harness.compare(out, ref + bias.to(ref.dtype).to(ref.device), tolerance)
        if why:
            return f"bias_epilogue (bias added by the kernel): {why}"
    return None


def _check_runs(
    report: ConformanceReport,
    b: Backend,
    per_problem: list[tuple[Problem, list[Tactic]]],
    device: DeviceInfo,
    samples: int,
    seed: int,
    tolerance: float,
    show_progress: bool | None,
) -> None:
    rng = random.Random(seed)
    jobs = [(p, t) for p, ts in per_problem for t in _sample(ts, samples, rng)]
    results: dict[str, list[tuple[Status, str]]] = {"build": [], "numerics": []}
    for i, (p, t) in enumerate(
        progress(jobs, desc=f"conformance {b.name}", unit="tactic", enable=show_progress)
    ):
        status, msg, category = _run_one(b, p, t, device, seed + i, tolerance)
        where = f"M={p.m} N={p.n} K={p.k} {p.out_dtype} {_json_of(t)}"
        results[category].append((status, f"{where}: {msg}"))
        if category == "numerics":
            results["build"].append(("PASS", where))
    if device.is_simulated:
        report.add(
            "numerics",
            "reference",
            "SKIP",
            f"{device.name} is simulated: kernels are built, not run",
            b.name,
        )
    for category, rows in results.items():
        if not rows:
            continue
        bad = [m for s, m in rows if s == "FAIL"]
        if bad:
            report.add(
                category, "sampled", "FAIL", f"{len(bad)} of {len(rows)}: {_quote(bad)}", b.name
            )
        else:
            what = "built" if category == "build" else "match the reference"
            report.add(category, "sampled", "PASS", f"{len(rows)} sampled tactics {what}", b.name)


def _device(device: str, backend: object) -> DeviceInfo:
    """`device` resolved with the installed families' profiles plus the backend's own
    (a backend under development is not installed, and its part may be new)."""
    if isinstance(backend, Backend) and backend.device_profiles:
        own = {p.alias: p for p in backend.device_profiles}
        if device in own and device not in profiles():
            return own[device].device
    return resolve(device)


def _tactics_per_problem(
    report: ConformanceReport, backend: Backend, problems: Sequence[Problem], dev: DeviceInfo
) -> list[tuple[Problem, list[Tactic]]]:
    """(problem, its tactics) for each problem `tactics()` answered; a FAIL when no
    problem got any tactic (the dispatcher would never pick the backend)."""
    per_problem = []
    for problem in problems:
        got = _tactics_for(report, backend, problem, dev)
        if got is not None:
            per_problem.append((problem, got))
    if per_problem and not any(ts for _, ts in per_problem):
        report.add(
            "tactics",
            "any",
            "FAIL",
            "no valid tactic for any sample problem: the dispatcher would never pick "
            "this backend (pass problems= it supports)",
            backend.name,
        )
    return per_problem


def check_backend(
    backend: Backend,
    device: str | DeviceInfo = "cpu",
    problems: Sequence[Problem] | None = None,
    samples: int = 4,
    *,
    seed: int = 0,
    tolerance: float = DEFAULT_TOLERANCE,
    show_progress: bool | None = None,
    report: ConformanceReport | None = None,
) -> ConformanceReport:
    """Check one backend object (no entry point needed), e.g. while writing it.

    ``samples`` tactics per problem are built and (on a device that runs kernels)
    compared with the reference; every offered tactic is checked for type, JSON and
    validity.
    """
    dev = device if isinstance(device, DeviceInfo) else _device(device, backend)
    problems = _for_operations(DEFAULT_PROBLEMS if problems is None else problems, backend)
    name = getattr(backend, "name", type(backend).__name__)
    report = report or ConformanceReport(str(name), dev.name)
    if not _check_definition(report, backend):
        return report
    support = _supports(report, backend, dev)
    if support is None:
        return report
    if not support.ok:
        for cat in ("tactics", "json", "validity", "build", "numerics"):
            report.add(
                cat, "all", "SKIP", f"not supported on {dev.name}: {support.reason}", backend.name
            )
        return report
    per_problem = _tactics_per_problem(report, backend, problems, dev)
    pairs = [(p, t) for p, ts in per_problem for t in ts]
    _check_estimates(report, backend, pairs, dev)
    distinct = list(dict.fromkeys(t for _, t in pairs))
    if distinct:
        _check_json(report, backend, distinct)
        _check_validity(report, backend, pairs, dev)
        _check_runs(report, backend, per_problem, dev, samples, seed, tolerance, show_progress)
    return report


# ---- the plugin, through its entry point ------------------------------------------------------


def _check_load(report: ConformanceReport, entry_point: str) -> registry.Registry | None:
    eps = [ep for ep in metadata.entry_points(group=registry.GROUP) if ep.name == entry_point]
    if not eps:
        names = sorted({ep.name for ep in metadata.entry_points(group=registry.GROUP)})
        report.add(
            "load",
            "entry-point",
            "FAIL",
            f"no entry point {entry_point!r} in group {registry.GROUP!r} (installed: "
            f"{', '.join(names) or 'none'}); add [project.entry-points.fp4_dispatch] "
            f'{entry_point} = "your_package.module" and install the package',
        )
        return None
    dists = ", ".join(f"{ep.value} ({ep.dist.name if ep.dist else '?'})" for ep in eps)
    report.add("load", "entry-point", "PASS", dists)
    reg = registry.load(strict=False)
    mine = [p for p in reg.plugins if p.name == entry_point]
    ok = True
    for p in mine:
        if p.status == "disabled":
            report.add("load", "enabled", "FAIL", f"{p.target}: disabled ({p.reason})")
            ok = False
        for e in p.errors:
            tail = e.traceback.strip().splitlines()[-3:]
            report.add("load", e.stage, "FAIL", f"{e.error_type}: {e.message} [{' | '.join(tail)}]")
            ok = False
    backends = [n for p in mine for n in p.backends]
    if not backends:
        if ok:
            report.add("load", "register", "FAIL", "the hook registered no backend")
        return None
    if ok:
        report.add("load", "register", "PASS", f"registered {', '.join(backends)}")
    return reg


def _check_dispatcher(
    report: ConformanceReport,
    names: list[str],
    dev: DeviceInfo,
    problems: Sequence[Problem],
    tolerance: float,
) -> None:
    """The real path: a Dispatcher lists, merges and runs the plugin's backends (under
    ``precision="fp8"``, so that backends of a lossy operation are merged too; exact
    problems rank as they do under "exact")."""
    d = Dispatcher(device=dev, strict=False, precision="fp8")
    rows = {r.name: r for r in d.backends()}
    for name in names:
        row = rows.get(name)
        if row is None or row.status == "failed":
            why = "missing" if row is None else row.reason
            report.add("dispatcher", "status", "FAIL", f"dispatcher lists it as {why}", name)
            continue
        report.add("dispatcher", "status", "PASS", f"{row.status}: {row.reason}", name)
        if row.status != "available":
            continue
        first = _check_merged(report, d, name, problems)
        if first is not None and not dev.is_simulated:
            _check_top_runs(report, d, name, *first, tolerance)


def _check_merged(
    report: ConformanceReport, d: Dispatcher, name: str, problems: Sequence[Problem]
) -> tuple[Problem, Candidate] | None:
    """The dispatcher's shortlists keep the backend's tactics (none dropped by the
    merge); returns the first problem it has a shortlisted candidate for, and that one."""
    kept, first = 0, None
    mine_problems = _for_operations(problems, d.registry.backends[name])
    for problem in mine_problems:
        op = "w4a16" if problem.operation in DENSE_OPERATIONS else problem.operation
        sl = d.candidates(problem.m, problem.n, problem.k, problem.out_dtype, op,
                          problem.groups)  # fmt: skip
        if name in sl.skipped:
            where = f"M={problem.m} N={problem.n} K={problem.k}"
            report.add("dispatcher", "merge", "FAIL", f"{where}: {sl.skipped[name]}", name)
        mine = [c for c in sl.candidates if c.backend == name]
        kept += len(mine)
        if mine and first is None:
            first = (problem, mine[0])
    report.add(
        "dispatcher",
        "shortlist",
        "PASS" if kept else "FAIL",
        f"{kept} shortlisted candidates over {len(mine_problems)} problems",
        name,
    )
    return first


def _check_top_runs(
    report: ConformanceReport,
    d: Dispatcher,
    name: str,
    problem: Problem,
    cand: Candidate,
    tolerance: float,
) -> None:
    """The shortlisted candidate runs through the dispatcher and matches the reference."""
    tdev = torch.device(d.device.torch_device)
    ops, ref = harness.random_operands(problem, tdev, 12345)
    dtype = harness.OUT_DTYPES[problem.out_dtype]
    out = torch.full((problem.m, problem.n), float("nan"), dtype=dtype, device=tdev)
    try:
        if isinstance(ops, DenseOperands) or problem.grouped:  # never swapped
            d.kernel_for(cand, problem)(ops, out)
        else:
            d.run_candidate(cand, ops, out)
    except Exception as exc:  # recorded as a failure of the plugin
        report.add("dispatcher", "run", "FAIL", f"run_candidate raised {_err(exc)}", name)
        return
    err, why = harness.compare(out, ref, _tolerance_for(cand.operation, tolerance))
    report.add(
        "dispatcher",
        "run",
        "FAIL" if why else "PASS",
        f"top candidate {_json_of(cand.tactic)} at M={problem.m}: "
        + (why or f"relative error {err:.2e}"),
        name,
    )


def check_plugin(
    entry_point: str,
    device: str | DeviceInfo = "cpu",
    problems: Sequence[Problem] | None = None,
    samples: int = 4,
    *,
    seed: int = 0,
    tolerance: float = DEFAULT_TOLERANCE,
    show_progress: bool | None = None,
) -> ConformanceReport:
    """Run every conformance check on the plugin installed as `entry_point`.

    ``device``: "cpu", "cuda[:N]", or a simulated family ("sm100", ...) where kernels
    are built but not run. Returns the report; call ``.raise_for_failures()`` to turn
    failures into an exception. Plugin errors never escape: they are failed checks.
    """
    try:
        dev = device if isinstance(device, DeviceInfo) else resolve(device)
    except RuntimeError as exc:  # "cuda" asked for on a machine without one: SKIP, not raise
        if not (isinstance(device, str) and device.startswith("cuda")):
            raise
        report = ConformanceReport(entry_point, device)
        report.add("device", "all", "SKIP", f"no CUDA device here ({exc})")
        return report
    problems = DEFAULT_PROBLEMS if problems is None else tuple(problems)
    report = ConformanceReport(entry_point, dev.name)
    reg = _check_load(report, entry_point)
    if reg is None:
        return report
    names = [n for p in reg.plugins if p.name == entry_point for n in p.backends]
    for name in names:
        check_backend(
            reg.backends[name],
            dev,
            problems,
            samples,
            seed=seed,
            tolerance=tolerance,
            show_progress=show_progress,
            report=report,
        )
    _check_dispatcher(report, names, dev, problems, tolerance)
    return report


# ---- pytest ---------------------------------------------------------------------------------
