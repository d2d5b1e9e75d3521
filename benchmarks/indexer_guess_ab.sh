#!/usr/bin/env bash
# The indexer's threshold guess on and off in one tree, alternating (one
# device call): the GPU indexer tests, then indexer_gpu_quick rounds.
#   bash benchmarks/indexer_guess_ab.sh OUT_DIR [ROUNDS]
set -u
out=${1:?usage: indexer_guess_ab.sh OUT_DIR [ROUNDS]}
rounds=${2:-2}
export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 300 python -m pytest -q -n 8 -m gpu tests/test_indexer_gpu.py tests/test_indexer.py 2>&1 | tail -4
for round in $(seq "$rounds"); do
    for beta in 0 1.75; do
        python -m benchmarks.indexer_gpu_quick --label "beta$beta" --n 131072 --heads 64 --ks 2048 256 \
            --topk-only --repeats 3 --guess-beta "$beta" | tee -a "$out/guess_ab.jsonl"
        python -m benchmarks.indexer_gpu_quick --label "beta$beta" --n 131072 --heads 32 --ks 2048 \
            --topk-only --repeats 3 --guess-beta "$beta" | tee -a "$out/guess_ab.jsonl"
        python -m benchmarks.indexer_gpu_quick --label "beta$beta" --n 32768 --heads 64 --ks 2048 \
            --topk-only --repeats 5 --guess-beta "$beta" | tee -a "$out/guess_ab.jsonl"
    done
done
for beta in 1.4 2.5; do
    python -m benchmarks.indexer_gpu_quick --label "beta$beta" --n 131072 --heads 64 --ks 2048 \
        --topk-only --repeats 3 --guess-beta "$beta" | tee -a "$out/guess_ab.jsonl"
done
