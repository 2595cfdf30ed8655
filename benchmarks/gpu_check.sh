#!/usr/bin/env bash
# The GPU checks of issue 24, run once on a CUDA machine (about 6 minutes,
# no network): the tests with a CUDA parametrization (`-m cuda`), the Triton
# kernels' tests on the real device, then `bench_gpu.py --quick`. Each part
# has its own time limit, so one failure does not eat the others; logs and
# the benchmark's JSON go to $OUT (default ./gpu-check-out).
#
#   bash benchmarks/gpu_check.sh                       # from anywhere
#   BENCH_ARGS="--device cpu --small --no-peers" bash benchmarks/gpu_check.sh  # a dry run
#
# No install needed: quantobs runs from src/ (PYTHONPATH). Python packages
# missing there (pydantic; llm-compressor for the comparison columns) are
# installed from wheels in ./.whl when present. The native C kernels are
# built when a C compiler is there; otherwise the torch path runs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SITE=/tmp/quantobs-site
status=0

if ! "$PY" -c "import pydantic" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
        .whl/*.whl >"$OUT/wheels.log" 2>&1 || echo "wheel install failed (see wheels.log)"
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi
{
    nvidia-smi -L 2>&1
    "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
    "$PY" -c "import pydantic; print('pydantic', pydantic.__version__)" 2>&1 | tail -1
} | tee "$OUT/env.txt"

echo "== native kernels (C; optional)"
if timeout 120 "$PY" src/quantobs/native/build.py >"$OUT/native_build.log" 2>&1; then
    echo "built"
else
    echo "not built (torch path; see native_build.log)"
fi

# pytest: peers' plugins off (pytest-benchmark turns xdist's note into an
# error under our warnings-as-errors); test files that import a package this
# machine lacks are reported as collection errors and skipped.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -p no:benchmark -o addopts=""
        -rfE --tb=short --maxfail=50)
if "$PY" -c "import xdist" 2>/dev/null; then PYTEST+=(-n 8); fi

echo "== CUDA tests (-m cuda)"
timeout 150 "${PYTEST[@]}" -m cuda --continue-on-collection-errors tests \
    >"$OUT/cuda_tests.log" 2>&1 || status=1
grep -v '^\[gw' "$OUT/cuda_tests.log" | tail -40

echo "== Triton kernels on the device"
shopt -s nullglob
triton_tests=(tests/native/triton/test_triton*.py tests/native/test_triton*.py)
if [ ${#triton_tests[@]} -gt 0 ]; then
    timeout 90 "${PYTEST[@]}" "${triton_tests[@]}" >"$OUT/triton_tests.log" 2>&1 || status=1
    grep -v '^\[gw' "$OUT/triton_tests.log" | tail -20
else
    echo "no tests/native/triton/test_triton*.py here" | tee "$OUT/triton_tests.log"
fi

echo "== aten ops and launches per update (gpu_ops.py, on the device)"
timeout 60 "$PY" benchmarks/gpu_ops.py --device cuda --json "$OUT/gpu_ops.json" \
    2>&1 | tee "$OUT/gpu_ops.log" | tail -12

echo "== bench_gpu.py ${BENCH_ARGS:---quick}"
timeout 230 "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS:---quick} --budget-s 190 \
    --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log" | grep -v "^\s*$"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== done (status $status); logs in $OUT"
exit $status
