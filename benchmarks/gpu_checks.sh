#!/bin/sh
# The CUDA path's checks in one go, for a machine with a CUDA GPU, torch and
# Triton but no vLLM (the GPU machines this project borrows), run from the
# repository root or from a copy of ucm_connector/, store_backends/,
# patches/, benchmarks/, tests/ and ucm_testing/:
#
#     sh benchmarks/gpu_checks.sh OUT [PART ...]
#
# PARTs (default: all, in this order; a call that must end within a time
# limit can take them a few at a time):
#   tests     the transfer, worker and checksum tests, CUDA cases
#             included (pytest.txt; about 2 minutes on an H100 machine;
#             two worker tests need redis-server and error without it)
#   sparse-tests  the sparse selection tests (sparse-tests.txt; about 1.5
#             minutes)
#   sanitize  the CUDA cases of the worker tests under torch's CUDA
#             sanitizer (TORCH_CUDA_SANITIZER=1), which fails a test whose
#             kernels on two streams touch one tensor with no event or wait
#             between them (sanitize.txt); it sees torch ops only, not the
#             copies ucm_connector/cudart.py makes through ctypes, nor
#             Triton's kernels; slow (11 transfer tests took 170 s), so
#             SANITIZE_TESTS names the files (default tests/test_worker.py)
#   worker    gpu_worker_bench.py: the worker's loads and saves against raw
#             copies, and saves inside a stand-in forward pass (worker.*);
#             again with 512 blocks (1 GiB, an 8k-token prefill's save),
#             where a save gathered after the forward pass holds the next
#             one's kernels for all but the staging ring's worth of its
#             copies to the host (worker512.*)
#   checksum  checksum_bench.py: xxh3 of sealed rows on 1..8 threads (checksum.*)
#   sparse    gpu_sparse_bench.py at 8k and 32k: selection, a reused choice,
#             attention over the kept blocks against dense (sparse.*)
#   channels  the same with block_topk's channels: 32 (channels.*)
#   kernel-sweep  gpu_kernel_sweep.py at 8k and 32k: the scoring kernel at
#             other positions per program and warps (kernel-sweep.txt)
#   transfer  gpu_bench.py without the large cache: gather and scatter by
#             layout against raw pinned copies (transfer.*)
# Each part's output goes to OUT; its exit status is printed.
set -u
OUT=${1:?usage: sh benchmarks/gpu_checks.sh OUT [tests sparse-tests sanitize worker checksum sparse channels kernel-sweep transfer]}
shift
PARTS=${*:-tests sparse-tests sanitize worker checksum sparse channels kernel-sweep transfer}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
# A test still running after PYTEST_TIMEOUT seconds (default 60) has every
# thread's stack written out (faulthandler: also where it waits inside C or
# CUDA), and then fails (pytest-timeout, where installed; a signal, which
# reaches a thread stuck in C only once it returns) rather than holding up
# the rest.
TIMEOUT="-o faulthandler_timeout=${PYTEST_TIMEOUT:-60}"
TIMEOUT="$TIMEOUT $(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${PYTEST_TIMEOUT:-60} --timeout-method=signal")"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" >> "$OUT/gpu.txt" 2>&1
for part in $PARTS; do
    case $part in
        tests)    python3 -m pytest -v -rfE --durations=15 -p no:cacheprovider $TIMEOUT tests/test_transfer.py tests/test_worker.py \
                      tests/test_checksums.py > "$OUT/pytest.txt" 2>&1 ;;
        sparse-tests) python3 -m pytest -v -rfE --durations=15 -p no:cacheprovider $TIMEOUT tests/test_sparse_select.py \
                      tests/test_sparse_speculative.py tests/test_sparse_channels.py > "$OUT/sparse-tests.txt" 2>&1 ;;
        sanitize) TORCH_CUDA_SANITIZER=1 python3 -m pytest -v -rfE -p no:cacheprovider $TIMEOUT -k "cuda and not cpu_tensors" \
                      ${SANITIZE_TESTS:-tests/test_worker.py} > "$OUT/sanitize.txt" 2>&1 ;;
        worker)   python3 benchmarks/gpu_worker_bench.py --json "$OUT/worker.json" > "$OUT/worker.txt" 2>&1
                  first=$?
                  python3 benchmarks/gpu_worker_bench.py --blocks 512 --json "$OUT/worker512.json" \
                      > "$OUT/worker512.txt" 2>&1
                  second=$?
                  [ $first -eq 0 ] && [ $second -eq 0 ] ;;
        checksum) python3 benchmarks/checksum_bench.py --blocks 128 --block-mib 2 --json "$OUT/checksum.json" \
                      > "$OUT/checksum.txt" 2>&1 ;;
        sparse)   python3 benchmarks/gpu_sparse_bench.py --contexts 8192 32768 --steps 10 --json "$OUT/sparse.json" \
                      > "$OUT/sparse.txt" 2>&1 ;;
        channels) python3 benchmarks/gpu_sparse_bench.py --contexts 8192 32768 --steps 10 --channels 32 \
                      --json "$OUT/channels.json" > "$OUT/channels.txt" 2>&1 ;;
        kernel-sweep) { python3 benchmarks/gpu_kernel_sweep.py --context 8192 --configs 8,1 32,4 16,1 16,2 &&
                      python3 benchmarks/gpu_kernel_sweep.py --context 32768 --configs 8,1 32,4 16,1 16,2; } \
                      > "$OUT/kernel-sweep.txt" 2>&1 ;;
        transfer) python3 benchmarks/gpu_bench.py --big-cache-gib 0 --no-sparse --json "$OUT/transfer.json" \
                      > "$OUT/transfer.txt" 2>&1 ;;
        *)        echo "unknown part '$part' (known: tests sparse-tests sanitize worker checksum sparse channels kernel-sweep transfer)" >&2; exit 2 ;;
    esac
    echo "$part: exit status $?"
done
