#!/usr/bin/env bash
# The GPU correctness tests and the GPU benchmark in one go, results into a folder:
#
#     benchmarks/run_gpu.sh OUTDIR
#
# Writes into OUTDIR: versions.txt, nvidia-smi.txt; kernels.log and kernels.json (the compile
# report, `attngrad kernels --quick`, for this GPU's architecture: its registers, spills and
# shared memory are what the next step checks against the driver); tests.log and tests.xml
# (JUnit) of tests/strategies/test_triton_gpu.py (the 2x rule on compiled kernels, TF32, and the compile
# report against torch.cuda's properties and the loaded kernels); then targets.log/.csv
# (benchmark_gpu.py at the target shape, N = 8192, d = 128 and 64) and benchmark_gpu.log/.csv
# (the sweep over N and d).  Each step has its own time limit so that the whole run stays
# under 10 minutes; a step cut short keeps what it wrote.  The exit status is that of the
# tests, else that of the report.
#
# The first of .venv/bin/python, python3, python whose torch sees a CUDA GPU runs it all
# (it needs triton and pytest too: pip install -e '.[gpu,test]').
set -uo pipefail
out=${1:?usage: benchmarks/run_gpu.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."

py=""
for candidate in .venv/bin/python python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
        "$candidate" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        py=$candidate
        break
    fi
done
if [ -z "$py" ]; then
    echo "run_gpu.sh: no python here whose torch sees a CUDA GPU; nothing to run" | tee "$out/tests.log"
    exit 2
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0  # compile the kernels for the GPU

nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$out/versions.txt"

arch=$("$py" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(f'sm_{major}{minor}')")
export ATTNGRAD_CACHE_DIR="$out/cache"  # the tests' cross-check reuses the report's binaries
timeout 120 "$py" -m attngrad kernels --target "$arch" --quick --json "$out/kernels.json" \
    2>&1 | tee "$out/kernels.log"
kernels=${PIPESTATUS[0]}

timeout 200 "$py" -m pytest -q -p no:cacheprovider tests/strategies/test_triton_gpu.py \
    --junitxml="$out/tests.xml" 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}

timeout 90 "$py" benchmarks/benchmark_gpu.py --seq 8192 --head-dim 128 64 \
    --csv "$out/targets.csv" 2>&1 | tee "$out/targets.log"

timeout 170 "$py" benchmarks/benchmark_gpu.py --csv "$out/benchmark_gpu.csv" 2>&1 \
    | tee "$out/benchmark_gpu.log"

rm -rf "$out/cache"
[ "$tests" -ne 0 ] && exit "$tests"
exit "$kernels"
