#!/usr/bin/env bash
# Build the wheel, install it into a fresh virtual environment with the test extras and the
# example plugins, and run the tests from outside the source tree (never against the
# source folders: that is how the bug this project came from hid).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${FP4_TEST_DIR:-$(mktemp -d -t fp4-dispatch-test.XXXXXX)}
extras=${FP4_TEST_EXTRAS:-test,cute}
py=${PYTHON:-python3}
start=$SECONDS

echo "== fresh venv in $work/venv"
rm -rf "$work/venv" "$work/dist" "$work/tests" "$work/example-plugin-tests"
"$py" -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q --upgrade pip
# torch 2.13.0 is a CPU build on local disk here; the project itself only needs torch>=2.8.
"$vpy" -m pip install -q "torch==2.13.0"

echo "== building the wheel"
"$vpy" -m pip wheel -q --no-deps -w "$work/dist" "$root"
wheel=$(ls "$work"/dist/fp4_dispatch-*.whl)
echo "   $wheel"

echo "== installing the wheel[$extras] and the example plugins"
"$vpy" -m pip install -q "$wheel[$extras]"
"$vpy" -m pip install -q --no-deps "$root/examples/example-plugin" "$root/examples/broken-plugin"

echo "== import layers of the installed package (import-linter, contracts in pyproject.toml)"
(cd "$work" && "$work/venv/bin/lint-imports" "$root/pyproject.toml")

echo "== pytest (from $work, not the source tree)"
cp -r "$root/tests" "$work/tests"
cd "$work"
export FP4_DISPATCH_SOURCE_ROOT="$root" FP4_DISPATCH_CACHE="$work/tuning-cache.json"
"$vpy" -m pytest tests -q -p no:cacheprovider "$@"

echo "== the example plugin's own conformance tests (fp4_dispatch.testing)"
cp -r "$root/examples/example-plugin/tests" "$work/example-plugin-tests"
"$vpy" -m pytest "$work/example-plugin-tests" -q -p no:cacheprovider
echo "== done in $((SECONDS - start)) s"
