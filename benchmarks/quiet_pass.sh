#!/bin/bash
# The quiet pass behind docs/performance.md's table (and the closed-loop and cluster rows
# of docs/planner.md): every benchmark with a goal, one at a time, on a machine with
# nothing else running. Usage: bash benchmarks/quiet_pass.sh OUT_DIR [PYTHON]
# Each benchmark's output goes to OUT_DIR/NAME.txt (its last lines are the table's rows);
# OUT_DIR/times.txt has each one's start time and the load average then.
set -u
out=${1:?usage: bash benchmarks/quiet_pass.sh OUT_DIR [PYTHON]}
py=${2:-python}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out" || exit 2
run() {
  local name=$1; shift
  echo "== $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" >> "$out/times.txt"
  "$@" > "$out/$name.txt" 2>&1
  echo "rc=$?" >> "$out/$name.txt"
}
run zero "$py" benchmarks/zero_vs_torch.py --runs 3
run dp "$py" benchmarks/dp_vs_ddp.py --first-bucket-ab --runs 3
run pp "$py" benchmarks/pp_vs_torch.py --pp 2 --microbatches 8 --dim 512 --layers 8 \
  --batch 16 --steps 4 --schedules all
run post "$py" benchmarks/post_validation.py --microbatches 8 --repeats 3
run tp "$py" benchmarks/tp_vs_dtensor.py --tp 2 --steps 6
run calibrate "$py" -m plait.cli calibrate --out "$out/p.json"
run closed "$py" benchmarks/plan_closed_loop.py --hardware "$out/p.json"
run cluster "$py" benchmarks/cluster_topology.py --mbit 100 --steps 30 --hardware "$out/p.json"
run sim "$py" benchmarks/simulate_scale.py --runs 3
echo "== end $(date -u +%H:%M:%S)" >> "$out/times.txt"
