#!/usr/bin/env bash
# Sequence shards on the one H200: 2 and 4 MPI ranks sharing the GPU through
# host staging; time per phase, bytes per rank, load balance, and a check
# against one process (benchmarks/mpi_h200.py says what each run does).
#
#   bash benchmarks/mpi_h200.sh [mpi_h200.py options]
#
# JSON and logs go to $OUT (else benchmarks/results). Each mpiexec is cut at
# 110 s; after the check (which also compiles the kernels) the Python side
# starts no size predicted to end past its 70 s budget, so the whole script
# ends within about 4 minutes (JSON is rewritten after every run). CPU dry run (no GPU: NumPy):
#   bash benchmarks/mpi_h200.sh --sizes 512 1024 --check-len 256 --topk 64 --index-heads 16 --heads 4
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1
flags=()
if mpiexec --version 2>&1 | grep -qiE "open ?mpi|openrte"; then
  # no core binding (ranks share the GPU, not cores); no CMA single copy (needs
  # ptrace rights a VM or container may not give); pass PYTHONPATH on
  flags=(--bind-to none --mca btl_vader_single_copy_mechanism none -x PYTHONPATH)
fi
python3 -c "import cupy; print('cupy', cupy.__version__, 'devices:', cupy.cuda.runtime.getDeviceCount())" || true
status=0
for ranks in 2 4; do
  timeout 110 mpiexec "${flags[@]}" -n "$ranks" python3 -m benchmarks.mpi_h200 --out "$out" "$@" \
    2>&1 | tee "$out/mpi_h200_np$ranks.log" || status=1
done
exit "$status"
