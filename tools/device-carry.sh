#!/usr/bin/env bash
# Builds build/device-carry/, what tools/device-check.sh installs on the device machine (issue 44):
# that machine has no network, so everything llmgw and the GPU tests import travels as wheels,
# in the device tool's `carry` (64 MiB with the work tree, all told).
#
#   - the llmgw wheel, pure (LLMGW_PURE=1): a compiled one is built for this machine's Python,
#     and the device machine's python3 is another (3.12 there, as seen in 2026-11; 3.11 here);
#   - its dependencies and pytest, pytest-trio and hypothesis, as binary wheels for CPython
#     DEVICE_PYTHON on x86-64 manylinux, at the versions the venv PYTHON runs the suite with
#     where those exist for that Python, from the package indexes pip is configured with.
#
# Then it measures what would travel (the work tree git would list, plus the carry) and fails
# over 64 MiB. Run it here, once per change of dependencies:
#   tools/device-carry.sh                                # PYTHON=.venv/bin/python, DEVICE_PYTHON=3.12
#   PYTHON=/path/to/venv/bin/python DEVICE_PYTHON=3.12 tools/device-carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
DIR=build/device-carry
LIMIT=$((64 * 1024 * 1024))

rm -rf "$DIR"
mkdir -p "$DIR"

LLMGW_PURE=1 "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-cache-dir \
    --wheel-dir "$DIR" . 2> >(grep -v 'LLMGW_PURE is set' >&2)
wheel=$(ls "$DIR"/llmgw-*-py3-none-any.whl)

# The versions the suite runs with, as constraints (a package with no wheel for DEVICE_PYTHON at
# that version makes pip say so and this script fail: then raise or drop its pin here).
"$PYTHON" -m pip freeze --disable-pip-version-check --exclude-editable \
    | grep -v -e '^llmgw==' -e ' @ ' -e '^-e ' > "$DIR/constraints.txt" || true

platforms=()
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --implementation cp --python-version "$DEVICE_PYTHON" "${platforms[@]}" \
    -c "$DIR/constraints.txt" -d "$DIR" "$wheel" pytest pytest-trio hypothesis \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)

echo "$DEVICE_PYTHON" > "$DIR/PYTHON"
(cd "$DIR" && ls ./*.whl | sed 's|^\./||' > MANIFEST)

carry=$(du -sb "$DIR" | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((carry + tree))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "device-carry: $(wc -l < "$DIR/MANIFEST") wheels for CPython $DEVICE_PYTHON in $DIR: $(mib "$carry"); with the work tree ($(mib "$tree")) $(mib "$total") of the 64 MiB a device call carries"
if [ "$total" -gt "$LIMIT" ]; then
    echo "device-carry: over the 64 MiB limit: the device tool would refuse the call" >&2
    exit 1
fi
