#!/usr/bin/env bash
# The indexer's threshold guess on and off, and against another tree's guess,
# alternating in one device call: the GPU indexer tests of this tree, then
# rounds of indexer_gpu_quick (one JSON line each, appended to OUT_DIR/guess_ab.jsonl).
#   bash benchmarks/indexer_guess_ab.sh OUT_DIR [ROUNDS [OTHER_TREE]]
set -u
out=${1:?usage: indexer_guess_ab.sh OUT_DIR [ROUNDS [OTHER_TREE]]}
rounds=${2:-2}
other=${3:-}
here=$(pwd)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
PYTHONPATH=. timeout 300 python -m pytest -q -n 8 -m gpu tests/test_indexer_gpu.py tests/test_indexer.py 2>&1 | tail -4
quick() {  # TREE LABEL BETA N HEADS REPEATS
    (cd "$1" && PYTHONPATH=. python -m benchmarks.indexer_gpu_quick --label "$2" --n "$4" --heads "$5" --ks 2048 \
        --topk-only --repeats "$6" --guess-beta "$3") | tee -a "$out/guess_ab.jsonl"
}
for round in $(seq "$rounds"); do
    for size in "131072 64 3" "131072 32 3" "32768 64 5"; do
        quick "$here" off 0 $size
        quick "$here" on 1.75 $size
        if [ -n "$other" ]; then quick "$other" other 1.75 $size; fi
    done
done
