#!/usr/bin/env bash
# On a machine whose MLX computes on a GPU (MLX's CUDA back-end; Metal alike): the tests
# whose results depend on the device, then the decode benchmark, as CI (which has no GPU)
# cannot run them. Each result goes into OUT:
#   device.txt           the MLX version and default device
#   tests.txt            pytest's output for the device-dependent test files (below)
#   bench_kv_cache.json  python benchmarks/bench_kv_cache.py --skip-memory [--contexts ...]
#   bench_kv_cache.log   its progress lines
#
#   bash benchmarks/on_a_gpu.sh [--quick] [OUT]   (OUT default: reports/gpu-run-YYYYmmdd-HHMMSS)
#
# --quick runs the benchmark at 256 and 4K only. On an H200 the tests take about 1.5
# minutes and the full benchmark about 2. Without a GPU it refuses (exit 2, one line):
# its figures would be the CPU's. Exit status: 0 if every test passed, 1 if a test failed
# or the benchmark did not finish, 2 on bad arguments or no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."

contexts=()
if [[ ${1:-} == --quick ]]; then
  contexts=(--contexts 256 4096)
  shift
fi
if (($# > 1)) || [[ ${1:-} == -* ]]; then
  echo "on_a_gpu.sh: expected [--quick] [OUT], got: $*" >&2
  exit 2
fi
out=${1:-reports/gpu-run-$(date +%Y%m%d-%H%M%S)}
python=${PYTHON:-python3}
# A checkout without `pip install -e .` (a GPU machine given the tree alone) imports from here.
export PYTHONPATH="$PWD:$PWD/spec${PYTHONPATH:+:$PYTHONPATH}"

device=$("$python" -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())') || {
  echo "on_a_gpu.sh: MLX does not import with $python" >&2
  exit 2
}
if [[ $device != *gpu* ]]; then
  echo "on_a_gpu.sh: MLX's default device is not a GPU ($device); its figures would be the CPU's" >&2
  exit 2
fi
mkdir -p "$out" || exit 2
echo "$device" > "$out/device.txt"

# The files whose results depend on the device: the store's reads and writes, the
# caches, decoding against mlx-lm, the fused kernel and the batched decode.
tests=(
  test_storage_conformance test_block_gather test_decode_writes test_decode_later_layers
  test_lazy_writes_threads test_kv_cache test_kv_cache_fork test_kv_cache_reservation
  test_mlx_lm_decode test_mlx_lm_drop_in test_state_set_exhaustion test_paged_attention
  test_batch_cache
)
paths=()
for name in "${tests[@]}"; do paths+=("tests/$name.py"); done
status=0
"$python" -m pytest -q -p no:cacheprovider "${paths[@]}" > "$out/tests.txt" 2>&1 || status=1
tail -n 1 "$out/tests.txt"
"$python" benchmarks/bench_kv_cache.py --skip-memory "${contexts[@]}" \
  > "$out/bench_kv_cache.json" 2> "$out/bench_kv_cache.log" || status=1
tail -n 1 "$out/bench_kv_cache.log"
echo "on_a_gpu.sh: results in $out"
exit $status
