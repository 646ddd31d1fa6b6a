#!/usr/bin/env bash
# llmgw against a real NVML, on a machine with an NVIDIA GPU (issue 44; docs/device-check.md).
#
# Without a GPU (every developer's and CI's machine) it prints one line saying so and exits 0.
# With one (the device machine some sessions are lent), it
#   1. installs build/device-carry/ (tools/device-carry.sh builds it here: the llmgw wheel and
#      every wheel it and the GPU tests need; that machine has no network) into a fresh
#      --target folder, and runs everything from there, not from src/;
#   2. runs the agent's discovery once (tools/device_probe.py): GPUs, memory, NVLink matrix,
#      PCIe, ECC, the Xid watcher's state, and raw NVML answers, as JSON;
#   3. runs `llmgw ctl doctor --local -o json`;
#   4. runs the tests marked gpu (with LLMGW_GPU_TESTS=require: a skip there would hide a broken
#      NVML), the fake-pynvml-against-the-real-module check and the discovery tests;
#   5. prints a summary of the three.
# Outputs go to $OUT (the device tool brings its files back) or build/device-check/ without it:
# summary.txt, nvidia-smi.txt, discovery.json, doctor.json, pytest.txt, stderr.txt.
# Exit: 0 all ran and passed (doctor's own verdict, ok to unknown, is reported, not judged),
# 1 a step failed, 2 the carry is missing or built for another Python.
#
# The per-step limits add up to under 5 minutes: call it with the device tool's timeout_s=300.
# LLMGW_DEVICE_CHECK_REHEARSE=1 takes the GPU path on a machine without one (to try the install
# and the steps here with a carry built for this machine's Python: DEVICE_PYTHON=3.11).
set -uo pipefail
cd "$(dirname "$0")/.."

has_gpu() {
    [ -n "${LLMGW_DEVICE_CHECK_REHEARSE:-}" ] && return 0
    compgen -G '/dev/nvidia[0-9]*' >/dev/null && return 0
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && return 0
    return 1
}

if ! has_gpu; then
    echo "device-check: no NVIDIA GPU on this machine (no /dev/nvidia*, no GPU in nvidia-smi -L): nothing to check; run it through the device tool (docs/device-check.md)"
    exit 0
fi

RESULTS=${OUT:-build/device-check}
mkdir -p "$RESULTS"
rm -f "$RESULTS"/{summary.txt,nvidia-smi.txt,discovery.json,doctor.json,pytest.txt,stderr.txt}
ERR=$RESULTS/stderr.txt
CARRY=build/device-carry
PY=${DEVICE_CHECK_PYTHON:-python3}
say() { echo "device-check: $*" | tee -a "$RESULTS/summary.txt"; }

if [ ! -f "$CARRY/MANIFEST" ]; then
    say "$CARRY is missing: build it with tools/device-carry.sh and name it in the device tool's carry"
    exit 2
fi
want=$(cat "$CARRY/PYTHON")
have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$want" != "$have" ]; then
    say "the carry is for CPython $want, $PY here is $have: rebuild it with DEVICE_PYTHON=$have tools/device-carry.sh"
    exit 2
fi

SITE=${TMPDIR:-/tmp}/llmgw-device-site
rm -rf "$SITE"
if ! timeout 60 "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-index --no-deps --no-compile \
        --no-cache-dir --target "$SITE" "$CARRY"/*.whl 2>>"$ERR"; then
    say "installing $CARRY failed (stderr.txt says why)"
    exit 1
fi
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
from=$("$PY" -c 'import llmgw, pynvml; print(llmgw.__file__, pynvml.__file__)')
say "$(wc -l < "$CARRY/MANIFEST") wheels installed in $SITE; llmgw and pynvml from: $from"

{ timeout 15 nvidia-smi -L; timeout 15 nvidia-smi topo -m; timeout 15 nvidia-smi -q; } >"$RESULTS/nvidia-smi.txt" 2>&1

failed=0
timeout 45 "$PY" tools/device_probe.py >"$RESULTS/discovery.json" 2>>"$ERR"
rc=$?
[ $rc -eq 0 ] || { say "discovery exited $rc (no GPUs from NVML, or the probe broke)"; failed=1; }

timeout 45 "$PY" -m llmgw ctl doctor --local --interval 1 -o json >"$RESULTS/doctor.json" 2>>"$ERR"
rc=$?  # Nagios: 0-2 its verdict, 3 unknown findings or could not run (then no report)
"$PY" -c 'import json, sys; sys.exit("findings" not in json.load(open(sys.argv[1])))' "$RESULTS/doctor.json" 2>/dev/null \
    || { say "ctl doctor --local could not run (exit $rc; stderr.txt says why)"; failed=1; }

LLMGW_GPU_TESTS=require PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout 90 "$PY" -m pytest -p pytest_trio.plugin \
    -p no:cacheprovider -o console_output_style=classic -rA \
    tests/unit/test_nvml_real.py tests/unit/test_nvml_api.py tests/unit/test_discovery.py \
    >"$RESULTS/pytest.txt" 2>&1
rc=$?
[ $rc -eq 0 ] || { say "pytest exited $rc"; failed=1; }

"$PY" tools/device_probe.py --summary "$RESULTS" | tee -a "$RESULTS/summary.txt"
say "$([ $failed -eq 0 ] && echo passed || echo FAILED): outputs in $RESULTS"
exit $failed
