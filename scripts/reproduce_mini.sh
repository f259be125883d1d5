#!/usr/bin/env bash
# The CPU-sized reproduction (experiment=mini/...): ViT-tiny on scikit-learn's digits, 11 to 20 minutes on 2 cores.
#   scripts/reproduce_mini.sh [OUT]        (default outputs/mini; a second call skips the runs already done)
# Then open OUT/report/*/report.md and the figures beside them.
set -euo pipefail
OUT=${1:-outputs/mini}
run() {  # experiment name, folder
  dpmem train -m "experiment=mini/$1" "hydra.sweep.dir=$OUT/runs/$2" train.skip_done=true logging.progress=false
}
run vit-digits-accuracy accuracy   # dp-adam, grape, galore-dp-naive x eps 1, 2, 4, 8 x 3 seeds
run vit-digits-memory memory       # adam, grape, dp-adam, galore-dp-naive x batch 64..512
run steps-grape steps/grape        # accuracy every 50 steps
run steps-dpzero steps/dpzero      # ten times the steps, accuracy every 200
for part in accuracy memory steps; do
  dpmem report "$OUT/runs/$part" --out "$OUT/report/$part"
done
echo "reports: $OUT/report/{accuracy,memory,steps}/report.md"
