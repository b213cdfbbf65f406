#!/usr/bin/env bash
# The GPU check, in one command, from the repository root of a machine with a GPU:
#
#     bash scripts/gpu_check.sh
#
# 1. preflight: torch, CUDA, the GPUs and their peer access (exits 2, "no CUDA
#    device: ...", when there is none);
# 2. the cuda_ipc and nccl conformance tests (tests/test_cuda_ipc.py, tests/test_nccl.py),
#    with GPU skips turned into failures;
# 3. two-process round trips of CUDA payloads through cuda_ipc (same GPU, and across
#    GPUs when there are two), every byte checked by the receiver, and a table of
#    bandwidth for 1 MiB, 64 MiB and 1 GiB next to a device-to-device copy.
#
# Uses .venv/bin/python (made by `make setup`; created that way if missing; the
# OMNIWIRE_PYTHON variable overrides it). Each step has a time limit; the whole
# check stays under 5 minutes. Needs nothing but the project and its venv.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 3

PY="${OMNIWIRE_PYTHON:-.venv/bin/python}"
if [ ! -x "$PY" ]; then
    echo "== $PY is missing: creating it with 'make setup'"
    if ! make setup; then
        echo "gpu check: cannot create the virtual environment (make setup failed)"
        exit 3
    fi
fi

# A venv whose torch is a CPU build cannot check anything: use a python on PATH that
# has a CUDA torch and omniwire's dependencies instead, if there is one.
has_cuda_torch() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}
if [ -z "${OMNIWIRE_PYTHON:-}" ] && ! has_cuda_torch "$PY"; then
    for alt in python3 python; do
        alt=$(command -v "$alt") || continue
        if has_cuda_torch "$alt" && "$alt" -c 'import msgspec, zmq, anyio' >/dev/null 2>&1; then
            echo "note: $PY has no CUDA torch; using $alt with PYTHONPATH=src"
            PY=$alt
            export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
            break
        fi
    done
fi

export OMP_NUM_THREADS=1 HYPOTHESIS_PROFILE=ci OMNIWIRE_GPU_CHECK=1 PYTHONUNBUFFERED=1

declare -a NAMES=() RESULTS=() TIMES=()
run_step() {  # run_step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    echo
    echo "== $name"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    NAMES+=("$name")
    TIMES+=("$(($(date +%s) - start)) s")
    case $rc in
        0) RESULTS+=("ok") ;;
        124 | 137) RESULTS+=("FAILED (over its ${limit} s limit)") ;;
        *) RESULTS+=("FAILED (exit $rc)") ;;
    esac
    return $rc
}

summary() {
    echo
    echo "== summary"
    printf '%-32s %-28s %s\n' "step" "result" "time"
    for i in "${!NAMES[@]}"; do
        printf '%-32s %-28s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}"
    done
}

run_step "preflight" 30 "$PY" scripts/gpu_check.py preflight
rc=$?
if [ $rc -ne 0 ]; then
    summary
    if [ $rc -eq 2 ]; then
        echo "gpu check: no CUDA device here; nothing to check"
    fi
    exit $rc
fi

TESTS=(tests/test_cuda_ipc.py)
if [ -f tests/test_nccl.py ]; then
    TESTS+=(tests/test_nccl.py)
else
    echo "note: tests/test_nccl.py is not in this checkout: the nccl tests are not run"
fi
failed=0
run_step "conformance: ${TESTS[*]}" 150 "$PY" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" || failed=1
run_step "round trips + bandwidth" 90 "$PY" scripts/gpu_check.py run || failed=1
summary
exit $failed
