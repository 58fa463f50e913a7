#!/usr/bin/env bash
# Runs qkv's GPU paths on a machine with an NVIDIA GPU and writes what happened into OUT_DIR: the
# tests of the CUDA paths, the README's Multi30k training on the GPU (bfloat16 autocast), the trained
# model evaluated on the GPU in float32 and bfloat16 and timed, and one torchrun process on NCCL.
#
#   scripts/gpu_check.sh MULTI30K_DIR OUT_DIR [TRAIN_SECONDS]
#
# Each step runs whatever happened to the one before it; OUT_DIR/summary.txt has one line per step
# (exit status and seconds) and OUT_DIR/STEP.log its output. The trained checkpoint comes back as
# OUT_DIR/en-de-gpu.tar; OUT_DIR must be new or empty. docs/distributed.md says what this has run on and what it found.
set -u
if [ $# -lt 2 ] || [ ! -d "$1" ]; then
    echo "usage: $0 MULTI30K_DIR OUT_DIR [TRAIN_SECONDS] (MULTI30K_DIR: a directory of Multi30k's .gz files)" >&2
    exit 2
fi
if [ -e "$2" ] && [ -n "$(ls -A "$2")" ]; then  # its files have fixed names: never write over someone's
    echo "$0: OUT_DIR $2 is not empty: give a new or empty directory" >&2
    exit 2
fi
DATA=$1 OUT=$2 BUDGET=${3:-120}  # seconds of training
PY=${PYTHON:-python3}
RUN=$(mktemp -d)/en-de
mkdir -p "$OUT"
export QKV_DATA=$DATA PYTHONUNBUFFERED=1

step() {  # step NAME TIMEOUT COMMAND...: run, log, and record the status and the seconds it took
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
    tail -n 4 "$OUT/$name.log"
}

step env 30 sh -c "nvidia-smi -L; nproc; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.is_bf16_supported())'"
step tests 150 "$PY" -m pytest -p no:cacheprovider -q -rs -n 8 tests/e2e/test_devices.py \
    tests/unit/test_precision_and_resume.py tests/e2e/test_bf16.py tests/e2e/test_decode.py
# --time-budget ends the training itself; the step's own limit is a backstop: the budget and 90 s more.
step train $((BUDGET + 90)) "$PY" -m qkv train --preset multi30k --src en --tgt de --data-dir "$DATA" \
    --out "$RUN" --device cuda --bf16 --time-budget "${BUDGET}s"
for precision in fp32 bf16; do
    flag=$([ $precision = bf16 ] && echo --bf16)
    step "evaluate-$precision" 90 "$PY" -m qkv evaluate --checkpoint "$RUN" --device cuda --beam 5 \
        --split test_2016_flickr $flag
done
step evaluate-cpu 120 "$PY" -m qkv evaluate --checkpoint "$RUN" --device cpu --beam 5 --split test_2016_flickr
step torchrun 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m qkv train \
    --preset multi30k --src en --tgt de --data-dir "$DATA" --out "$(dirname "$RUN")/ddp" --max-steps 40
tar -C "$RUN" -cf "$OUT/en-de-gpu.tar" final log.jsonl 2>/dev/null || echo "no checkpoint to return" >> "$OUT/summary.txt"
