#!/usr/bin/env bash
# Build the wheel from a clean export of the tree, install it into a fresh virtual
# environment with the test extras and the example plugins, and run the tests from outside
# the source tree (never against the source folders: that is how the bug this project came
# from hid).
#
# FP4_TEST_DIR: the work folder (default: a new temporary one, removed at exit);
# FP4_TEST_KEEP=1: keep the work folder (its path is printed); FP4_TEST_EXTRAS: the extras
# (default test,cute,flashinfer); FP4_TEST_WORKERS: pytest worker processes (default one
# per core, at most 8; 0 runs the tests in one process); FP4_TEST_INSTALLER: what installs
# the wheel and its extras, uv (default: parallel downloads and unpacking, ~1 min less
# than pip cold on the 2-core machine) or pip; PYTHON: the interpreter that makes the venv. Arguments go to the main pytest run. Each phase prints its seconds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${FP4_TEST_DIR:-}" ]; then
  work=$FP4_TEST_DIR
  mkdir -p "$work"
else
  work=$(mktemp -d -t fp4-dispatch-test.XXXXXX)
fi
extras=${FP4_TEST_EXTRAS:-test,cute,flashinfer}
py=${PYTHON:-python3}
start=$SECONDS

cleanup() {
  if [ "${FP4_TEST_KEEP:-0}" = "1" ]; then
    echo "== kept the work folder: $work"
  elif [ -n "${FP4_TEST_DIR:-}" ]; then
    rm -rf "$work/venv" "$work/src" "$work/dist" "$work/tests" "$work/example-plugin-tests" \
      "$work"/*.log
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

echo "== clean export of the tree in $work/src"
rm -rf "$work/venv" "$work/src" "$work/dist" "$work/tests" "$work/example-plugin-tests"
bash "$root/scripts/export.sh" "$work/src"
src="$work/src"

phase() {  # the seconds so far, then the next phase's title
  echo "   (${SECONDS}s in all)"
  echo "== $*"
}

phase "fresh venv in $work/venv"
"$py" -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q --upgrade pip

phase "torch and, beside it, the wheel"
# torch 2.13.0 is the CPU build CI uses; the project itself only needs torch>=2.8. The
# wheel builds in its own isolated environment meanwhile (no write to the venv).
"$vpy" -m pip wheel -q --no-deps -w "$work/dist" "$src" > "$work/wheel.log" 2>&1 &
wheel_pid=$!
"$vpy" -m pip install -q "torch==2.13.0"
wait "$wheel_pid" || { cat "$work/wheel.log"; exit 1; }
wheel=$(ls "$work"/dist/fp4_dispatch-*.whl)
echo "   $wheel"

phase "installing the wheel[$extras] and the example plugins"
# one resolution for all three; the plugins' "fp4-dispatch" requirement is the wheel itself
targets=("$wheel[$extras]" "$src/examples/example-plugin" "$src/examples/broken-plugin")
if [ "${FP4_TEST_INSTALLER:-uv}" = "uv" ]; then
  # torch stays the CPU build installed above (it satisfies every requirement); bytecode
  # is compiled as pip does, so no test process compiles the libraries' sources again
  "$vpy" -m pip install -q uv
  "$work/venv/bin/uv" pip install -q --python "$vpy" --compile-bytecode "${targets[@]}"
else
  "$vpy" -m pip install -q "${targets[@]}"
fi

phase "import layers of the installed package (import-linter, contracts in pyproject.toml)"
(cd "$work" && "$work/venv/bin/lint-imports" "$root/pyproject.toml")

ncpu=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
workers=${FP4_TEST_WORKERS:-$((ncpu < 8 ? ncpu : 8))}
phase "pytest (from $work, not the source tree; $workers worker processes)"
cp -r "$src/tests" "$work/tests"
cp -r "$src/examples/example-plugin/tests" "$work/example-plugin-tests"
cd "$work"
export FP4_DISPATCH_SOURCE_ROOT="$src" FP4_DISPATCH_CACHE="$work/tuning-cache.json"
# The example plugin's own conformance tests (fp4_dispatch.testing) run beside the suite,
# in a pytest of their own (no conftest of ours), with a tuning cache of their own.
FP4_DISPATCH_CACHE="$work/example-cache.json" "$vpy" -m pytest "$work/example-plugin-tests" \
  -q -p no:cacheprovider > "$work/example-plugin-tests.log" 2>&1 &
example_pid=$!
# --dist loadfile: a module's tests run in one worker, so a module fixture (an interpreter
# run, a compile, a spawned process group) is built once; the modules with the most tests
# go first. Each worker has caches of its own (tests/conftest.py).
status=0
"$vpy" -m pytest tests -q -p no:cacheprovider -n "$workers" --dist loadfile "$@" || status=$?
example_status=0
wait "$example_pid" || example_status=$?

phase "the example plugin's own conformance tests (fp4_dispatch.testing), run beside it"
cat "$work/example-plugin-tests.log"
echo "== done in $((SECONDS - start)) s"
[ "$status" -eq 0 ] || exit "$status"
exit "$example_status"
