#!/usr/bin/env bash
# The GPU correctness tests and the GPU benchmark in one go, results into a folder:
#
#     benchmarks/run_gpu.sh OUTDIR
#
# Writes OUTDIR/tests.log, OUTDIR/tests.xml (JUnit), OUTDIR/benchmark_gpu.log,
# OUTDIR/benchmark_gpu.csv and OUTDIR/nvidia-smi.txt.  Each step has its own time
# limit so that the whole run stays under 8 minutes; the exit status is that of
# the tests.  Uses .venv when there is one, else the python on PATH (which must
# have torch with CUDA, triton and attngrad[test]).
set -uo pipefail
out=${1:?usage: benchmarks/run_gpu.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=python
[ -x .venv/bin/python ] && py=.venv/bin/python
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0  # compile the kernels for the GPU

if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "run_gpu.sh: no CUDA GPU visible to torch here; nothing to run" | tee "$out/tests.log"
    exit 2
fi
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    | tee "$out/versions.txt"

timeout 210 "$py" -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py \
    --junitxml="$out/tests.xml" 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}

timeout 240 "$py" benchmarks/benchmark_gpu.py --csv "$out/benchmark_gpu.csv" 2>&1 \
    | tee "$out/benchmark_gpu.log"

exit "$tests"
