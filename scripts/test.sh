#!/usr/bin/env bash
# Build the wheel from a clean export of the tree, install it into a fresh virtual
# environment with the test extras and the example plugins, and run the tests from outside
# the source tree (never against the source folders: that is how the bug this project came
# from hid).
#
# FP4_TEST_DIR: the work folder (default: a new temporary one, removed at exit);
# FP4_TEST_KEEP=1: keep the work folder (its path is printed); FP4_TEST_EXTRAS: the extras
# (default test,cute,flashinfer); PYTHON: the interpreter that makes the venv.
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
    rm -rf "$work/venv" "$work/src" "$work/dist" "$work/tests" "$work/example-plugin-tests"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

echo "== clean export of the tree in $work/src"
rm -rf "$work/venv" "$work/src" "$work/dist" "$work/tests" "$work/example-plugin-tests"
bash "$root/scripts/export.sh" "$work/src"
src="$work/src"

echo "== fresh venv in $work/venv"
"$py" -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q --upgrade pip
# torch 2.13.0 is the CPU build CI uses; the project itself only needs torch>=2.8.
"$vpy" -m pip install -q "torch==2.13.0"

echo "== building the wheel"
"$vpy" -m pip wheel -q --no-deps -w "$work/dist" "$src"
wheel=$(ls "$work"/dist/fp4_dispatch-*.whl)
echo "   $wheel"

echo "== installing the wheel[$extras] and the example plugins"
"$vpy" -m pip install -q "$wheel[$extras]"
"$vpy" -m pip install -q --no-deps "$src/examples/example-plugin" "$src/examples/broken-plugin"

echo "== import layers of the installed package (import-linter, contracts in pyproject.toml)"
(cd "$work" && "$work/venv/bin/lint-imports" "$root/pyproject.toml")

echo "== pytest (from $work, not the source tree)"
cp -r "$src/tests" "$work/tests"
cd "$work"
export FP4_DISPATCH_SOURCE_ROOT="$src" FP4_DISPATCH_CACHE="$work/tuning-cache.json"
"$vpy" -m pytest tests -q -p no:cacheprovider "$@"

echo "== the example plugin's own conformance tests (fp4_dispatch.testing)"
cp -r "$src/examples/example-plugin/tests" "$work/example-plugin-tests"
"$vpy" -m pytest "$work/example-plugin-tests" -q -p no:cacheprovider
echo "== done in $((SECONDS - start)) s"
