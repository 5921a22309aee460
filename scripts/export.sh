#!/usr/bin/env bash
# Copy a clean export of the checkout into DEST: the files git tracks (plus new files git
# does not ignore), never build/, *.egg-info or other ignored leftovers, which a wheel
# built in place would ship (a deleted module once came back that way).
# Usage: scripts/export.sh DEST   (DEST must not exist or be empty)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:?usage: scripts/export.sh DEST}
mkdir -p "$dest"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # --cached lists files deleted in the work tree too: keep only those that exist
  (cd "$root" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf -) | tar -xf - -C "$dest"
else
  # not a git checkout (e.g. an unpacked sdist): copy, then drop build leftovers
  cp -a "$root/." "$dest/"
  find "$dest" \( -name build -o -name dist -o -name '*.egg-info' -o -name __pycache__ \
    -o -name .venv \) -prune -exec rm -rf {} +
fi
