#!/usr/bin/env bash
# One GPU check (issue 16), from the repository, in at most 8 minutes:
#   1. set up .venv (scripts/_venv.sh);
#   2. run every `gpu`-marked test in tests/gpu (1-GPU tests always; the NCCL ones skip
#      themselves below 2 GPUs);
#   3. a short benchmark printing one table (scripts/gpu_bench.py): device memcpy (the floor),
#      colocated cuda-ipc refit on one GPU, NCCL (>= 2 GPUs), quantize.
# Without a GPU it says so, runs the CPU-side quantization tests and the colocated benchmark
# on its CPU twin (shm), and exits with their status (0 when they pass).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
t0=$SECONDS
ngpu="$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$ngpu" -eq 0 ]; then
    echo "gpu_check: no CUDA GPU visible (torch $(python -c 'import torch; print(torch.__version__)')):" \
         "running the CPU-side quantization tests only" >&2
    timeout 300 python -m pytest -q tests/unit/test_quant.py tests/unit/test_quant_convert.py \
        tests/unit/test_quant_refit_plan.py tests/sim/test_quant_refit.py
    # the colocated benchmark's code path, on its CPU twin (shm refit against the host memcpy floor)
    timeout 120 python -m streamer.tools.bench_ipc --transport shm --size 64MiB --repeats 3
    echo "gpu_check: CPU-side quantization tests and the shm benchmark passed; GPU tests and GPU benchmark" \
         "not run (no GPU)" >&2
    exit 0
fi
echo "gpu_check: $ngpu GPU(s): $(python -c 'import torch; print(torch.cuda.get_device_name(0))')" >&2
status=0
# budget: tests 240 s, benchmark 150 s, setup the rest of the 8 minutes
timeout 240 python -m pytest -q -rs -m gpu tests/gpu || status=$?
timeout 150 python scripts/gpu_bench.py || status=$?
echo "gpu_check: done in $((SECONDS - t0)) s after setup (exit $status)" >&2
exit $status
