#!/usr/bin/env bash
# Check megalite on one CUDA GPU and measure it, in one command (docs/performance.md, "GPU checks").
#   bash benchmarks/gpu_check.sh                    # CUDA if present, else the --dry-run below
#   bash benchmarks/gpu_check.sh --dry-run          # no GPU needed: tiny CPU stand-ins for the CUDA steps
#   bash benchmarks/gpu_check.sh --out DIR          # where the results go (default ./gpu_check_out)
#   bash benchmarks/gpu_check.sh --only cp_blocks   # only the named steps (comma-separated), e.g. a rerun
# Steps: env | correctness (GPTModel cuda vs cpu, fp32 + bf16) | cp_blocks (context-parallel block kernels vs
# the math path; not run without CUDA) | doc_attention (the CUDA document kernel vs the masked
# SDPA; not run without CUDA) | attention_sinks (GPT-OSS's sinks on the CUDA block kernels vs the
# softmax with the sink's column; not run without CUDA) | linear_attention (fla's gated delta
# rule vs megalite's torch rule; not run without CUDA or fla) | host syncs per iteration | offload
# (device memory with and without --optimizer-cpu-offload; not run without CUDA) | train x3
# (pretrain.py bf16, no/selective/full recompute) | gloo TP parity on CPU | single_device.py (CPU:
# it has no device flag).
# Each step has its own timeout, all capped by a total time limit (GC_TIME_LIMIT seconds, default
# 420), so one hang does not lose the rest. Writes summary.txt (also printed), summary.json and
# gpu_check.log to the output folder. Exit status 1 if a step failed or timed out; a step that
# could not run here (exit status 77) is "skip" and listed as not run.
set -u
cd "$(dirname "$0")/.."
OUT=./gpu_check_out DRY=0 ONLY=""
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1; shift;;
    --out) [ $# -ge 2 ] || { echo "gpu_check.sh: --out needs a folder, e.g. --out ./gpu_check_out" >&2; exit 2; }
           OUT=$2; shift 2;;
    --only) [ $# -ge 2 ] || { echo "gpu_check.sh: --only needs step names, e.g. --only cp_blocks,train_none" >&2; exit 2; }
            ONLY=",$2,"; shift 2;;
    -h|--help) sed -n '2,18p' "$0"; exit 0;;
    *) echo "gpu_check.sh: unknown argument '$1'; valid: --dry-run, --out DIR, --only STEPS, --help" >&2; exit 2;;
  esac
done
STEPS="env correctness cp_blocks doc_attention attention_sinks linear_attention host_syncs offload train_none train_selective train_full gloo_tp_parity single_device_vs_hf nccl_multi_rank"
for n in $(echo "${ONLY//,/ }"); do
  case " $STEPS " in *" $n "*) ;; *) echo "gpu_check.sh: --only: unknown step '$n'; valid: ${STEPS// /, }" >&2; exit 2;; esac
done
# The interpreter: $PYTHON, else the first of python / python3 that imports torch (a machine's
# python3 can be the system one while `python` is the environment's).
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python python3; do
    command -v $c >/dev/null 2>&1 && $c -c "import torch" >/dev/null 2>&1 && { PY=$c; break; }
  done
  [ -n "$PY" ] || { echo "gpu_check.sh: neither python nor python3 imports torch; set PYTHON=/path/to/python" >&2; exit 2; }
fi
LIMIT=${GC_TIME_LIMIT:-420}
case $LIMIT in ''|*[!0-9]*) echo "gpu_check.sh: GC_TIME_LIMIT='$LIMIT' is not a whole number of seconds" >&2; exit 2;; esac
WORK=$(mktemp -d)
mkdir -p "$OUT" || { echo "gpu_check.sh: cannot create output folder '$OUT'" >&2; exit 2; }
LOG=$OUT/gpu_check.log
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
START=$SECONDS
: >"$LOG"

if [ "$DRY" = 0 ] && $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>>"$LOG"; then
  MODE=gpu DEV=cuda
  MODEL="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --micro-batch-size 8 --vocab-size 50257 --bf16"
  ITERS="--train-iters 30 --log-interval 5"
  SD="--threads $(nproc) --rounds 4"
else
  MODE=dry-run DEV=cpu
  [ "$DRY" = 1 ] || echo "NO CUDA DEVICE: CUDA steps are replaced by tiny CPU stand-ins (dry run); numbers are not GPU measurements."
  MODEL="--num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 64 --micro-batch-size 2 --vocab-size 512 --bf16"
  ITERS="--train-iters 6 --log-interval 2"
  SD="--num-layers 1 --hidden-size 64 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2 --vocab-size 512 --rounds 2 --warmup 1"
fi
echo "gpu_check: mode=$MODE device=$DEV out=$OUT time limit=${LIMIT}s" | tee -a "$LOG"

# wanted NAME: whether --only (if given) names the step
wanted() { [ -z "$ONLY" ] || case $ONLY in *",$1,"*) true;; *) false;; esac; }

# step NAME TIMEOUT NOTE CMD... : run CMD under timeout (capped by what is left of the time limit),
# log its output, append "name status rc seconds note" to $WORK/steps.tsv.
step() {
  local name=$1 limit=$2 note=$3; shift 3
  wanted "$name" || return 0
  local left=$((LIMIT - (SECONDS - START) - 15))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    printf '%s\tskip\t0\t0\t%s\n' "$name" "total time limit reached" >>"$WORK/steps.tsv"; return
  fi
  echo "=== $name (timeout ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS rc status
  timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1; rc=$?
  case $rc in 0) status=pass;; 77) status=skip;; 124|137) status=timeout;; *) status=fail;; esac
  echo "=== $name: $status (rc $rc, $((SECONDS - t0)) s)" | tee -a "$LOG"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" "$note" >>"$WORK/steps.tsv"
}

step env 90 "" $PY benchmarks/gpu_check.py env --result "$WORK/env.json"
step correctness 150 "GPTModel $DEV vs cpu: fp32 close, bf16 sane" \
  $PY benchmarks/gpu_check.py correctness --device $DEV --result "$WORK/correctness.json"
# the CUDA kernels themselves, so --device cuda even in a dry run (where it reports not run)
step cp_blocks 90 "CP block kernels (flash/cudnn/efficient) vs math, fwd+bwd, bf16+fp32" \
  $PY benchmarks/gpu_check.py cp_blocks --device cuda --result "$WORK/cp_blocks.json"
step doc_attention 90 "document kernel (varlen) vs masked SDPA, fwd+bwd, bf16+fp32" \
  $PY benchmarks/gpu_check.py doc_attention --device cuda --result "$WORK/doc_attention.json"
step attention_sinks 90 "sink attention (block kernels) vs the softmax with a sink column, fwd+bwd" \
  $PY benchmarks/gpu_check.py attention_sinks --device cuda --result "$WORK/attention_sinks.json"
step linear_attention 90 "fla gated delta rule vs megalite's torch rule, fwd+bwd, bf16+fp32" \
  $PY benchmarks/gpu_check.py linear_attention --device cuda --result "$WORK/linear_attention.json"
step host_syncs 150 "per iteration, 2 vs 8 layers and micro-batches" \
  $PY benchmarks/gpu_check.py syncs --device $DEV --result "$WORK/host_syncs.json"
step offload 120 "device memory with and without --optimizer-cpu-offload, bf16 ZeRO 0" \
  $PY benchmarks/gpu_check.py offload --device cuda --result "$WORK/offload.json"
for g in none selective full; do
  extra=""; [ $g != none ] && extra="--recompute-granularity $g"
  step "train_$g" 150 "pretrain.py $DEV recompute=$g" \
    $PY pretrain.py --device $DEV --mock-data $MODEL $ITERS $extra --lr-warmup-iters 5 \
      --eval-interval 100000 --eval-iters 0 --metrics-file "$WORK/train_$g.jsonl"
done
if ! wanted gloo_tp_parity; then :
elif $PY -c "import pytest" >/dev/null 2>&1; then
  step gloo_tp_parity 150 "CPU gloo, 4 procs; NCCL needs 2+ GPUs (skipped)" \
    env CUDA_VISIBLE_DEVICES= $PY -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py -k match_single_device
else
  printf 'gloo_tp_parity\tskip\t0\t0\t%s\n' "not run: pytest is not installed" >>"$WORK/steps.tsv"
fi
step single_device_vs_hf 150 "CPU only: script has no --device flag" \
  bash -o pipefail -c "$PY benchmarks/single_device.py --json $SD | tee /dev/stderr | tail -1 > '$WORK/single_device_vs_hf.json'"

wanted nccl_multi_rank && printf 'nccl_multi_rank\tskip\t0\t0\t%s\n' "not run: NCCL across ranks needs 2+ GPUs (env shows a 1-rank NCCL all-reduce)" >>"$WORK/steps.tsv"
$PY benchmarks/gpu_check.py summarize --work "$WORK" --out "$OUT" --mode "$MODE" | tee -a "$LOG"
rm -rf "$WORK"
grep -q '"all_pass": true' "$OUT/summary.json"
