#!/bin/bash
# benchmarks/sharing.py on a lent GPU machine (the device tool: Python 3.12, CUDA torch, no network, 16 cores, at most
# 10 minutes a command): one process per (arm, seed), all at once, each node on the GPU (model.device auto) with one
# CPU thread. What the node imports beyond that machine's packages travels in .whl/ (`make gpu-wheels`) and
# .whl/swarm/ (hivemind and what it imports: the in-process exchange signs records as the DHT transport does; see
# benchmarks/notebook/2026-11-27-gpu.md, "The sharing benchmark on a GPU"). Each (arm, seed) appends its line to $OUT/sharing_gpu.jsonl when it ends; logs in
# $OUT/logs. Usage: benchmarks/sharing_on_device.sh SECONDS "ARM:SEED ARM:SEED ..." [sharing.py options...]
set -u
limit=$1
runs=$2
shift 2
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl .whl/*.tar.gz .whl/swarm/*.whl .whl/swarm/*.tar.gz 2>&1 | grep -v SyntaxWarning | tail -3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
out=${OUT:-/tmp/out}
mkdir -p "$out/logs"
nvidia-smi --query-gpu=name --format=csv,noheader
pids=()
for run in $runs; do
  arm=${run%%:*}
  seed=${run##*:}
  timeout "$limit" python3 benchmarks/sharing.py --arms "$arm" --seeds "$seed" --results "$out/sharing_gpu.jsonl" "$@" \
    > "$out/logs/$arm-$seed.log" 2>&1 &
  pids+=($!)
done
start=$SECONDS
while :; do
  alive=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=$((alive + 1)); done
  [ "$alive" -eq 0 ] && break
  sleep 30
  echo "$((SECONDS - start)) s: $alive running; lines: $(cat "$out/sharing_gpu.jsonl" 2>/dev/null | wc -l)"
  tail -qn1 "$out"/logs/*.log | cut -c1-150
done
wait
echo "done in $((SECONDS - start)) s"
