#!/usr/bin/env bash
# A copy of neptune_fusion at git revision REV, importable as `nf_before`, for bench/ab_attention.py.
#   bash bench/ab_baseline.sh REV      (here; then carry .baseline to the device and put it on PYTHONPATH)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: ab_baseline.sh REV}
rm -rf .baseline && mkdir -p .baseline
git archive "$rev" src/neptune_fusion | tar -x -C .baseline
mv .baseline/src/neptune_fusion .baseline/nf_before && rmdir .baseline/src
grep -rl neptune_fusion .baseline/nf_before | xargs sed -i 's/neptune_fusion/nf_before/g'
echo "nf_before = $(git rev-parse --short "$rev") in .baseline/"
