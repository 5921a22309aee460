"""``fp4-dispatch doctor``: self-check every backend that loads here.

Modelled on tinygrad's device self-check. Per backend, four checks, each PASS, FAIL or
SKIP: ``load`` (the plugin loaded and the backend supports this device), ``tactic`` (it
offers a valid tactic, for W4A4 when it serves it, else for its own operation - W4A16 or
the lossy W4A8 - with dense activations; when it has none at the test shape, doctor tries
a few other M before it SKIPs), ``build`` (its best tactic builds; on a simulated device only for
backends that compile ahead of time, e.g. CuTe-DSL) and ``run`` (a GEMM against the
float64 reference; SKIP on a simulated device, which runs nothing). Exit status 1 only
for a FAIL (or when no backend is available at all). A plugin that failed to load is
listed with its error, as in ``list-backends``; with ``--strict`` (or
``FP4_DISPATCH_STRICT=1``) it is a FAIL row too.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .common import (
    add_command,
    add_device_args,
    add_json_arg,
    device_json,
    emit_json,
    format_table,
    make_dispatcher,
    parse_shape,
)

log = logging.getLogger(__name__)
TOLERANCE = 1e-2  # relative Frobenius error; bf16 output rounding is ~4e-3
#: other M tried when a backend has no tactic at the test shape (small decode to prefill)
FALLBACK_M = (128, 256, 1024, 4096, 16, 1)
CHECKS = ("load", "tactic", "build", "run")
#: SKIP details that only repeat an earlier check's outcome (left out of the table)
_DERIVED = ("did not load", "no tactic", "build failed")


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "doctor",
        help="self-check every backend that loads here",
        description="Check every available backend: it loads, offers a tactic, builds it "
        "and computes a small GEMM within 1e-2 of the float64 reference. On a simulated "
        "device the run check is SKIP (nothing runs) and only backends that compile ahead "
        "of time are built. Exit status 1 only for a real failure.",
        examples="""fp4-dispatch doctor
fp4-dispatch doctor --device sm100        # load, tactics and one CuTe-DSL compile, no GPU
fp4-dispatch doctor --shape 128x512x1024 --json""",
    )
    add_device_args(p)
    add_json_arg(p)
    p.add_argument(
        "--shape",
        default=(96, 256, 512),
        type=parse_shape,
        metavar="M,N,K",
        help="the test GEMM, M,N,K or MxNxK (default 96,256,512)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="a plugin that fails to load is a FAIL (exit 1); also FP4_DISPATCH_STRICT=1",
    )
    p.set_defaults(func=run)


#: the expert count of the test problem of a family that serves only grouped operations
#: (small: the doctor checks that a kernel runs and is right, not its speed)
DOCTOR_GROUPS = 4


def _check(result: dict[str, Any], name: str, status: str, detail: str = "") -> None:
    result["checks"][name] = {"result": status, "detail": detail}


def _find_tactic(backend, device, shape: tuple[int, int, int]):
    """The backend's best candidate at `shape`, else at (M', N, K) for M' in FALLBACK_M.

    Returns (candidate or None, problem, why-not). A ``tactics()`` that raises is a FAIL,
    reported through why-not starting with "tactics() raised".
    """
    from ..ranking import shortlist  # noqa: PLC0415 - lazy: start-up time
    from ..tactics import GROUPED_OPERATIONS, Problem  # noqa: PLC0415 - lazy: start-up time

    m, n, k = shape
    why = ""
    ops = tuple(backend.operations)
    op = "w4a4" if "w4a4" in ops or not ops else ops[0]
    groups = DOCTOR_GROUPS if op in GROUPED_OPERATIONS else None  # a grouped-only family
    for mm in (m, *(x for x in FALLBACK_M if x != m)):
        problem = Problem(m=mm, n=n, k=k, operation=op, groups=groups)
        sl = shortlist(problem, device, [backend], budget=1)
        if sl.candidates:
            return sl.candidates[0], problem, ""
        why = sl.skipped.get(backend.name, "") or why
        if why.startswith("tactics() raised"):
            return None, problem, why
    tried = ", ".join(str(x) for x in dict.fromkeys((m, *FALLBACK_M)))
    return (
        None,
        None,
        f"no valid tactic at N={n} K={k} for M in {tried}" + (f" ({why})" if why else ""),
    )


def check_backend(dispatcher, name: str, shape: tuple[int, int, int]) -> dict[str, Any]:
    """Run the four checks for one available backend (see the module docstring)."""
    backend = dispatcher.registry.backends[name]
    device = dispatcher.device
    result: dict[str, Any] = {"backend": name, "checks": {}}
    _check(result, "load", "PASS", dispatcher._status[name][1])
    cand, problem, why = _find_tactic(backend, device, shape)
    if cand is None:
        failed = why.startswith("tactics() raised")
        _check(result, "tactic", "FAIL" if failed else "SKIP", why)
        for c in ("build", "run"):
            _check(result, c, "SKIP", "no tactic")
        return _summarize(result)
    result["tactic"] = cand.tactic.model_dump(mode="json")
    result["shape"] = [problem.m, problem.n, problem.k]
    _check(result, "tactic", "PASS", f"M={problem.m} N={problem.n} K={problem.k}")
    if device.is_simulated and not backend.compile_only_note:
        _check(result, "build", "SKIP", "builds at first launch; needs the real device")
    else:
        try:
            dispatcher.kernel_for(cand, problem)
        except Exception as exc:  # reported as FAIL with the error, never hidden
            log.debug("doctor: %s build raised", name, exc_info=True)
            _check(result, "build", "FAIL", f"{type(exc).__name__}: {exc}")
            _check(result, "run", "SKIP", "build failed")
            return _summarize(result)
        _check(result, "build", "PASS")
    if device.is_simulated:
        _check(result, "run", "SKIP", f"{device.name} is simulated: nothing runs")
    else:
        _run_check(dispatcher, cand, problem, result)
    return _summarize(result)


def _run_check(dispatcher, cand, problem, result: dict[str, Any]) -> None:
    """Quantize random data, run the candidate, compare with the float64 reference."""
    import torch  # noqa: PLC0415 - lazy: start-up time

    from ..backend import GemmOperands  # noqa: PLC0415 - lazy: start-up time
    from ..harness import CHECK_RTOL_LOSSY, random_operands  # noqa: PLC0415 - lazy: start-up time
    from ..nvfp4 import quantize_nvfp4, reference_gemm  # noqa: PLC0415 - lazy: start-up time
    from ..tactics import is_lossy  # noqa: PLC0415 - lazy: start-up time

    m, n, k = problem.m, problem.n, problem.k
    try:
        device = torch.device(dispatcher.device.torch_device)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        if problem.grouped:  # experts over balanced routing: the kernel itself
            from ..grouped import reference_output  # noqa: PLC0415 - lazy: start-up time
            from ..harness import make_inputs  # noqa: PLC0415 - lazy: start-up time

            inputs = make_inputs(problem, dispatcher.device, copies=1)
            ops, out = inputs.copies[0], inputs.out.fill_(float("nan"))
            dispatcher.kernel_for(cand, problem)(ops, out)
            ref = reference_output(ops)
        elif problem.dense:  # dense activations (never swapped): the kernel itself
            ops, ref = random_operands(problem, device, 0)
            dispatcher.kernel_for(cand, problem)(ops, out)
        else:
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(m, k, generator=gen).to(device)
            b = torch.randn(n, k, generator=gen).to(device)
            qa, qb = quantize_nvfp4(a), quantize_nvfp4(b)
            ref = reference_gemm(qa, qb)
            alpha = (qa.global_scale * qb.global_scale).reshape(1)
            ops = GemmOperands(qa.data, qa.scale, qb.data, qb.scale, alpha)
            dispatcher.run_candidate(cand, ops, out)
        err = float((out.double().cpu() - ref.cpu()).norm() / ref.norm())
    except Exception as exc:  # reported as FAIL with the error, never hidden
        log.debug("doctor: %s raised", result["backend"], exc_info=True)
        _check(result, "run", "FAIL", f"{type(exc).__name__}: {exc}")
        return
    result["rel_error"] = err
    # a lossy operation (W4A8) is checked at the tuner's bound for it
    tol = max(TOLERANCE, CHECK_RTOL_LOSSY) if is_lossy(cand.operation) else TOLERANCE
    ok = err == err and err < tol  # NaN never passes
    _check(result, "run", "PASS" if ok else "FAIL",
           f"rel. error {err:.2e}" + ("" if ok else f" >= {tol}"))  # fmt: skip


def _summarize(result: dict[str, Any]) -> dict[str, Any]:
    """``result``: FAIL if a check failed, PASS if build or run passed, else SKIP."""
    states = [c["result"] for c in result["checks"].values()]
    if "FAIL" in states:
        result["result"] = "FAIL"
    elif "PASS" in (result["checks"]["build"]["result"], result["checks"]["run"]["result"]):
        result["result"] = "PASS"
    else:
        result["result"] = "SKIP"
    bad = [c["detail"] for c in result["checks"].values() if c["result"] == "FAIL"]
    result["error"] = bad[0] if bad else ""
    return result


def run(args: argparse.Namespace) -> int:
    d = make_dispatcher(args, strict=False)  # failures shown, not raised
    from ..registry import strict_default  # noqa: PLC0415 - lazy: start-up time

    results = [check_backend(d, b.name, args.shape) for b in d.available]
    statuses = d.backends()
    if args.strict or strict_default():  # a plugin that fails to load fails the check
        results += [_failed_load(s) for s in statuses if s.status == "failed"]
        not_run = [s for s in statuses if s.status not in ("available", "failed")]
    else:  # as list-backends: shown with its error, the other backends are what is checked
        not_run = [s for s in statuses if s.status != "available"]
    m, n, k = args.shape
    if args.json:
        emit_json({"device": device_json(d.device), "shape": [m, n, k], "results": results,
                   "not_run": [s.to_json() for s in not_run]})  # fmt: skip
    else:
        _print(d, args.shape, results, not_run)
    if not d.available:
        log.error("no backend is available on %s", d.device.name)
        return 1
    return 1 if any(r["result"] == "FAIL" for r in results) else 0


def _failed_load(status) -> dict[str, Any]:
    """A plugin or backend that failed to load: a FAIL row (it is a real failure here)."""
    result: dict[str, Any] = {"backend": status.name, "checks": {}}
    _check(result, "load", "FAIL", status.reason)
    for c in ("tactic", "build", "run"):
        _check(result, c, "SKIP", "did not load")
    return _summarize(result)


def _print(d, shape, results: list[dict], not_run: list) -> None:
    m, n, k = shape
    print(f"device: {d.device.name} ({d.device.kind}); test GEMM M={m} N={n} K={k}\n")
    rows = []
    for r in results:
        checks = r["checks"]
        details = [f"{c}: {checks[c]['detail']}" for c in CHECKS
                   if checks[c]["result"] == "FAIL"][:1]  # fmt: skip
        if not details and checks["run"]["result"] == "PASS":
            details = [checks["run"]["detail"]]
        if not details:
            details = [
                f"{c}: {checks[c]['detail']}"
                for c in CHECKS
                if checks[c]["result"] == "SKIP" and checks[c]["detail"] not in _DERIVED
            ]
        rows.append((r["backend"], r["result"], *(checks[c]["result"] for c in CHECKS),
                     "; ".join(details)))  # fmt: skip
    print(format_table(rows, ("backend", "result", *CHECKS, "detail")))
    if not_run:
        print("\nnot checked here:")
        for s in not_run:
            print(f"  {s.name} [{s.status}] {s.reason}")
