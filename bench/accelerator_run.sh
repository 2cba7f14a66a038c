#!/usr/bin/env bash
# The accelerator commands of docs/benchmarks/accelerators.md as one script with a deadline, for a
# GPU lent for minutes: each step runs under `timeout` with what is left of DEADLINE_S, a step
# that fails or runs out is logged and the next one starts, and every JSON written so far is in
# $RESULTS (a folder) when the script ends, whatever happened.
#
#   RESULTS=bench/results DEADLINE_S=540 PYTHON=python3 [SUFFIX=h200] bash bench/accelerator_run.sh
#
# Step 0 is a toy run (seconds): if the stack cannot run the engine at all, the script stops
# there, before the minutes are spent. The steps come in order of importance, so a deadline
# cuts the least important: the ConvNet's paper run in float32 and bfloat16, the GRU's with
# XLA's scan and with the Pallas kernels, the engine against per-client loops (gru, lstm, cnn),
# then the rest. Each step's name, exit code and seconds go to $RESULTS/accelerator_steps_$S.jsonl.
#
# BACKEND (gpu | tpu | cpu) is jax's default backend unless set; a machine whose jax falls back
# to the CPU stops unless BACKEND=cpu is given (to test this script's logic: BACKEND=cpu
# DEADLINE_S=40 runs the toy step and skips the rest). What is GPU-only sits behind $B == gpu:
# --rnn_impl=pallas (Triton kernels), --deterministic (XLA's deterministic GPU ops) and the
# PyTorch loop on CUDA; elsewhere the comparison times the engine against the JAX loop on the
# same device.
set -u
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-bench/out}
DEADLINE_S=${DEADLINE_S:-540}
START=$(date +%s)
export PYTHONUNBUFFERED=1
if [[ -z "${BACKEND:-}" ]]; then
  B=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null) || B=unknown
  if [[ $B != gpu && $B != tpu ]]; then
    echo "jax's backend is '$B', not an accelerator: stopping (BACKEND=cpu runs the steps on the CPU)"
    exit 1
  fi
else
  B=$BACKEND
fi
S=${SUFFIX:-$B}  # the JSON names' suffix: the card, e.g. h200, when several GPU kinds are compared
mkdir -p "$RESULTS"
LOG="$RESULTS/accelerator_steps_$S.jsonl"
SKIPPED=99

step() {  # step NAME MAX_S COMMAND...: returns the command's exit code, or SKIPPED
  local name=$1 max=$2; shift 2
  local left=$(( DEADLINE_S - ($(date +%s) - START) ))
  if (( left < 20 )); then
    echo "=== $name: skipped, ${left} s left"
    printf '{"step": "%s", "rc": null, "s": 0, "skipped": "%s s left"}\n' "$name" "$left" >> "$LOG"
    return $SKIPPED
  fi
  (( max > left )) && max=$left
  echo "=== $name (at most ${max} s; $(( $(date +%s) - START )) s in)"
  local t0=$(date +%s)
  timeout -k 5 "$max" "$@"; local rc=$?
  echo "=== $name: rc $rc in $(( $(date +%s) - t0 )) s"
  printf '{"step": "%s", "rc": %d, "s": %d, "max_s": %d}\n' "$name" "$rc" \
    "$(( $(date +%s) - t0 ))" "$max" >> "$LOG"
  return $rc
}

gpu_only() {  # gpu_only NAME: true on a GPU, else logs the step as not run here
  [[ $B == gpu ]] && return 0
  echo "=== $1: not run on $B (GPU only)"
  printf '{"step": "%s", "rc": null, "s": 0, "skipped": "GPU only, backend %s"}\n' "$1" "$B" >> "$LOG"
  return 1
}

"$PY" - <<'PY'
import jax, flax, optax, chex, numpy
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "chex", chex.__version__, "numpy", numpy.__version__)
print("devices", jax.devices())
PY
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
echo "backend $B, suffix $S, deadline ${DEADLINE_S} s, results in $RESULTS"

step toy 120 "$PY" -m bench.paper_grid --model=linear --scale=0.01 --rounds=1 --min_seconds=0 \
  --out="$RESULTS/toy.json"
rc=$?
if (( rc != 0 )); then
  (( rc == SKIPPED )) && echo "no time for the toy run: stopping" || echo "the toy run failed: stopping"
  exit 1
fi
rm -f "$RESULTS/toy.json"

BF16=--flag=--compute_dtype=bfloat16
PALLAS=--flag=--rnn_impl=pallas
SCAN=--flag=--rnn_impl=scan
# The PyTorch loop on CUDA where torch sees a GPU; elsewhere the engine against the JAX loop.
if [[ $B == gpu ]] && "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
    2>/dev/null; then
  CMP=(--torch_device=cuda)
else
  echo "=== compare: no PyTorch on CUDA here: the engine against the JAX loop only"
  CMP=(--methods=engine,jax_loop)
fi

# 1. The ConvNet's paper run (emnist.flags), float32 then bfloat16.
step "paper_grid cnn" 100 "$PY" -m bench.paper_grid --model=cnn \
  --out="$RESULTS/paper_grid_cnn_$S.json"
step "paper_grid cnn bf16" 100 "$PY" -m bench.paper_grid --model=cnn $BF16 \
  --out="$RESULTS/paper_grid_cnn_bf16_$S.json"
# 2. The GRU (shakespeare.flags, ~10 s a round in float32 with the scan): two timed rounds.
step "paper_grid gru scan" 120 "$PY" -m bench.paper_grid --model=gru --rounds=2 $SCAN \
  --out="$RESULTS/paper_grid_gru_$S.json"
gpu_only "paper_grid gru pallas" && step "paper_grid gru pallas" 120 "$PY" -m bench.paper_grid \
  --model=gru --rounds=2 $PALLAS --out="$RESULTS/paper_grid_gru_pallas_$S.json"
# 3. The engine against per-client loops on the same device. The GRU round (m = 100 of 544
# Shakespeare-like clients) is ~10^4 SGD steps a round for a per-client loop: 2 timed rounds,
# and no JAX loop on the GPU (the PyTorch loop on cuDNN is the reference).
GRU_CMP=("${CMP[@]}")
[[ ${CMP[0]} == --torch_device=cuda ]] && GRU_CMP+=(--methods=engine,torch)
step "compare gru" 120 "$PY" -m bench.compare --model=gru --rounds=2 "${GRU_CMP[@]}" \
  --out="$RESULTS/compare_gru_$S.json"
step "compare lstm" 60 "$PY" -m bench.compare --model=lstm "${CMP[@]}" \
  --out="$RESULTS/compare_lstm_$S.json"
step "compare cnn" 90 "$PY" -m bench.compare --model=cnn "${CMP[@]}" \
  --out="$RESULTS/compare_cnn_$S.json"
# 4. The rest: the LSTM and linear paper runs, the GRU in bfloat16, the estimates.
step "paper_grid lstm scan" 60 "$PY" -m bench.paper_grid --model=lstm $SCAN \
  --out="$RESULTS/paper_grid_lstm_$S.json"
gpu_only "paper_grid lstm pallas" && step "paper_grid lstm pallas" 60 "$PY" -m bench.paper_grid \
  --model=lstm $PALLAS --out="$RESULTS/paper_grid_lstm_pallas_$S.json"
if gpu_only "paper_grid gru pallas bf16"; then
  step "paper_grid gru pallas bf16" 120 "$PY" -m bench.paper_grid --model=gru --rounds=2 \
    $PALLAS $BF16 --out="$RESULTS/paper_grid_gru_pallas_bf16_$S.json"
else
  step "paper_grid gru bf16" 120 "$PY" -m bench.paper_grid --model=gru --rounds=2 $BF16 \
    --out="$RESULTS/paper_grid_gru_bf16_$S.json"
fi
step "paper_grid linear" 60 "$PY" -m bench.paper_grid --model=linear \
  --out="$RESULTS/paper_grid_linear_$S.json"
# The estimates print their figures: stdout is kept in $RESULTS/estimate_emnist*_$S.txt too.
TEE=(bash -c 'set -o pipefail; f=$1; shift; "$@" | tee "$f"' tee)
step "estimate emnist" 90 "${TEE[@]}" "$RESULTS/estimate_emnist_$S.txt" "$PY" -m experiments.run \
  --flagfile=experiments/emnist.flags --estimate
step "estimate emnist bf16" 90 "${TEE[@]}" "$RESULTS/estimate_emnist_bf16_$S.txt" "$PY" -m \
  experiments.run --flagfile=experiments/emnist.flags --estimate --compute_dtype=bfloat16
gpu_only "estimate emnist --deterministic" && step "estimate emnist --deterministic" 90 \
  "${TEE[@]}" "$RESULTS/estimate_emnist_deterministic_$S.txt" "$PY" -m experiments.run \
  --flagfile=experiments/emnist.flags --estimate --deterministic
step "scaling cnn" 90 "$PY" -m bench.scaling --platform=$B --devices=1 --model=cnn \
  --out="$RESULTS/scaling_$S.json"
step "loop_shape cnn" 90 "$PY" -m bench.loop_shape --model=cnn \
  --out="$RESULTS/loop_shape_cnn_$S.json"
step "loop_shape linear" 60 "$PY" -m bench.loop_shape --model=linear \
  --out="$RESULTS/loop_shape_linear_$S.json"
step "image_convs" 60 "$PY" -m bench.image_convs --out="$RESULTS/image_convs_$S.json"
echo "=== done in $(( $(date +%s) - START )) s"
