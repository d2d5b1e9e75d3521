#!/usr/bin/env bash
# Issue 9: the sequence shards on several GPUs, one MPI rank per GPU (NCCL
# between distinct GPUs, NVLink multicast off). benchmarks/mpi_scaling.py
# says what each part runs.
#
#   bash benchmarks/mpi_scaling.sh [mpi_scaling.py options]       # a 2- or 4-GPU machine
#
# Everything ends within $TOTAL_BUDGET_S (default 480 s, counted from the start):
# 1. for P in $RANKS (default: 1 2 4, those not above the GPU count): one
#    job with the check (N=8192 against one GPU), weak (262144 tokens per GPU)
#    and strong (N=1048576) scaling, cut at $JOB_BUDGET_S + 100 s (default 180 s)
#    or earlier when the budget left must keep 90 s for each later job and 60 s
#    for the probe; the Python side starts no timed run predicted to end past
#    the cut less 100 s (start-up, check, kernel compilation);
# 2. the longest-sequence probe on the largest P: one whole layer per fresh
#    job, N doubling from $PROBE_START (default 262144 * P) until a job fails
#    (out of memory), is cut at the budget left or N passes $PROBE_MAX, then
#    one size halfway between the last that ran and the first out of memory;
# 3. the report (table, efficiencies, longest N) and the plot if matplotlib
#    is there (else, on another machine: python -m benchmarks.mpi_scaling --plot JSON).
#
# JSON ($OUT/mpi_scaling.json) and logs go to $OUT (else benchmarks/results).
# CPU dry run (no GPU: NumPy ranks, host transport, tiny sizes):
#   RANKS="1 2 4" PROBE_START=1024 PROBE_MAX=8192 bash benchmarks/mpi_scaling.sh --cpu \
#     --check-len 512 --weak-per-gpu 512 --strong-len 2048 --query-chunk 256 --topk 32 \
#     --index-heads 4 --index-dim 16 --heads 2 --d-qk 24 --d-v 16
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1
py="$(command -v python3 || command -v python)"
flags=()
if mpiexec --version 2>&1 | grep -qiE "open ?mpi|openrte"; then
  # no core binding; no CMA single copy (needs ptrace rights a VM or container may
  # not give); pass the environment on to every rank
  flags=(--bind-to none --mca btl_vader_single_copy_mechanism none -x PYTHONPATH -x NCCL_NVLS_ENABLE
         -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS -x NUMBA_NUM_THREADS)
fi
gpus=0
if [[ " $* " != *" --cpu "* ]]; then
  gpus=$("$py" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)
  nvidia-smi topo -m 2>/dev/null | tee "$out/mpi_scaling_topology.txt" || true
fi
ranks="${RANKS:-}"
if [[ -z "$ranks" ]]; then
  for p in 1 2 4; do
    if (( gpus == 0 || p <= gpus )); then ranks="$ranks $p"; fi
  done
fi
echo "GPUs: $gpus; ranks: $ranks; results in $out"
job_budget="${JOB_BUDGET_S:-80}"
total_budget="${TOTAL_BUDGET_S:-480}"
status=0

run() {  # run P SECONDS LOG ARGS...: one mpiexec job, cut after SECONDS; its log under $out
  local p="$1" limit="$2" log="$3"
  shift 3
  timeout "$limit" mpiexec "${flags[@]}" -n "$p" "$py" -m benchmarks.mpi_scaling --out "$out" "$@" > "$log" 2>&1
  local rc=$?
  cat "$log"
  return "$rc"
}
left() { echo $((total_budget - SECONDS)); }

largest=1
after=$(wc -w <<< "$ranks")
for p in $ranks; do
  after=$((after - 1))
  limit=$(( $(left) - 90 * after - 60 ))  # keep 90 s for each job after this one and 60 s for the probe
  limit=$(( limit < job_budget + 100 ? limit : job_budget + 100 ))
  if (( limit < 40 )); then echo "P=$p: not run, the total budget is spent"; status=1; continue; fi
  run "$p" "$limit" "$out/mpi_scaling_np$p.log" --parts check weak strong --budget-s $((limit - 100 > 10 ? limit - 100 : 10)) "$@" \
    || { echo "P=$p: the job failed or was cut (exit $?)"; status=1; }
  largest=$p
done

# the probe: every size a fresh job (out of memory aborts it), each cut at the budget left
n="${PROBE_START:-$((262144 * largest))}"
good=0 bad=0
while (( $(left) > 30 && n <= ${PROBE_MAX:-1073741824} )); do
  log="$out/mpi_scaling_probe_np${largest}_$n.log"
  run "$largest" "$(left)" "$log" --parts probe --probe-len "$n" "$@"
  rc=$?
  if (( rc == 0 )); then good=$n n=$((n * 2)); continue; fi
  if grep -qiE "out ?of ?memory" "$log"; then echo "probe N=$n P=$largest: out of memory"; bad=$n
  elif (( rc == 124 )); then echo "probe N=$n P=$largest: cut at the time budget"
  else echo "probe N=$n P=$largest failed (exit $rc, not out of memory)"; status=1; fi
  break
done
step=$((128 * largest))  # N stays a multiple of the zigzag chunks' 64-token alignment
mid=$(( (good + bad) / 2 / step * step ))
if (( good > 0 && bad > 0 && mid > good && $(left) > 30 )); then
  run "$largest" "$(left)" "$out/mpi_scaling_probe_np${largest}_$mid.log" --parts probe --probe-len "$mid" "$@" \
    || echo "probe N=$mid P=$largest did not run to the end"
fi

"$py" -m benchmarks.mpi_scaling --report "$out/mpi_scaling.json" || status=1
"$py" -m benchmarks.mpi_scaling --plot "$out/mpi_scaling.json" || true
echo "done in $SECONDS s"
exit "$status"
