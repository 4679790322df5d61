#!/bin/bash
# The quiet pass: every benchmark with a goal, one at a time, on a machine with nothing
# else running, each writing its table to docs/results/ (docs/performance.md lists them).
# Usage: bash benchmarks/quiet_pass.sh OUT_DIR [PYTHON]
# Each benchmark's printed output goes to OUT_DIR/NAME.txt; OUT_DIR/times.txt has each
# one's start time and the load average then.
set -u
out=${1:?usage: bash benchmarks/quiet_pass.sh OUT_DIR [PYTHON]}
py=${2:-python}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out" || exit 2
res=docs/results
run() {
  local name=$1; shift
  echo "== $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" >> "$out/times.txt"
  "$@" > "$out/$name.txt" 2>&1
  echo "rc=$?" >> "$out/$name.txt"
}
run zero "$py" benchmarks/zero_vs_torch.py --runs 3 --write "$res/zero_vs_torch.md"
run hsdp "$py" benchmarks/hsdp_vs_torch.py --model tiny --steps 8 --runs 5 \
  --write "$res/hsdp_vs_torch.md"
run dp "$py" benchmarks/dp_vs_ddp.py --first-bucket-ab --runs 3 --write "$res/dp_vs_ddp.md"
run pp "$py" benchmarks/pp_vs_torch.py --pp 2 --microbatches 8 --dim 512 --layers 8 \
  --batch 16 --steps 4 --schedules all --write "$res/pp_vs_torch.md"
run post "$py" benchmarks/post_validation.py --microbatches 8 --repeats 3 \
  --write "$res/post_validation.md"
run tp "$py" benchmarks/tp_vs_dtensor.py --tp 2 --steps 6 --write "$res/tp_vs_dtensor.md"
# each calibrates this machine first (plait calibrate), so its command stands alone
run closed "$py" benchmarks/plan_closed_loop.py --write "$res/plan_closed_loop.md"
run cluster "$py" benchmarks/cluster_topology.py --write "$res/cluster_topology.md"
run sim "$py" benchmarks/simulate_scale.py --runs 3 --write "$res/simulate_scale.md"
run search "$py" benchmarks/plan_search.py --write "$res/plan_search.md"
echo "== end $(date -u +%H:%M:%S)" >> "$out/times.txt"
