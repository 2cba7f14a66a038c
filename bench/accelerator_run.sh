#!/usr/bin/env bash
# The accelerator commands of docs/benchmarks/accelerators.md as one script with a deadline, for a
# GPU lent for minutes: each step runs under `timeout` with what is left of DEADLINE_S, a step
# that fails or runs out is logged and the next one starts, and every JSON written so far is in
# $RESULTS (a folder) when the script ends, whatever happened.
#
#   RESULTS=bench/results DEADLINE_S=540 PYTHON=python3 [SUFFIX=h200] bash bench/accelerator_run.sh
#
# Step 0 is a toy run (seconds): if the stack cannot run the engine at all, the script stops
# there, before the minutes are spent.
set -u
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-bench/out}
DEADLINE_S=${DEADLINE_S:-540}
B=${BACKEND:-gpu}
S=${SUFFIX:-$B}  # the JSON names' suffix: the card, e.g. h200, when several GPU kinds are compared
mkdir -p "$RESULTS"
START=$(date +%s)
export PYTHONUNBUFFERED=1

step() {  # step NAME MAX_S COMMAND...
  local name=$1 max=$2; shift 2
  local left=$(( DEADLINE_S - ($(date +%s) - START) ))
  if (( left < 20 )); then echo "=== $name: skipped, ${left} s left"; return 1; fi
  (( max > left )) && max=$left
  echo "=== $name (at most ${max} s; $(( $(date +%s) - START )) s in)"
  local t0=$(date +%s)
  timeout -k 5 "$max" "$@"; local rc=$?
  echo "=== $name: rc $rc in $(( $(date +%s) - t0 )) s"
  return $rc
}

"$PY" - <<'PY'
import jax, flax, optax, chex, numpy
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "chex", chex.__version__, "numpy", numpy.__version__)
print("devices", jax.devices())
PY
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null

step toy 120 "$PY" -m bench.paper_grid --model=linear --scale=0.01 --rounds=1 --min_seconds=0 \
  --out="$RESULTS/toy.json" || { echo "the toy run failed: stopping"; exit 1; }
rm -f "$RESULTS/toy.json"

for m in cnn linear gru lstm; do
  step "paper_grid $m" 150 "$PY" -m bench.paper_grid --model=$m \
    --out="$RESULTS/paper_grid_${m}_$S.json"
done
step "estimate emnist" 90 "$PY" -m experiments.run --flagfile=experiments/emnist.flags --estimate
step "estimate emnist --deterministic" 90 "$PY" -m experiments.run \
  --flagfile=experiments/emnist.flags --estimate --deterministic
step "scaling cnn" 90 "$PY" -m bench.scaling --platform=$B --devices=1 --model=cnn \
  --out="$RESULTS/scaling_$S.json"
step "loop_shape cnn" 90 "$PY" -m bench.loop_shape --model=cnn \
  --out="$RESULTS/loop_shape_cnn_$S.json"
step "loop_shape linear" 60 "$PY" -m bench.loop_shape --model=linear \
  --out="$RESULTS/loop_shape_linear_$S.json"
step "compare cnn" 120 "$PY" -m bench.compare --model=cnn --torch_device=cuda \
  --out="$RESULTS/compare_cnn_$S.json"
step "image_convs" 60 "$PY" -m bench.image_convs --out="$RESULTS/image_convs_$S.json"
echo "=== done in $(( $(date +%s) - START )) s"
