#!/usr/bin/env bash
# Every benchmark of DESIGN.md section 5 in one device call (about 5 minutes on the H200), each
# correct against fp32 and timed against its baselines in the same run. Results land in $OUT
# (or bench/results): copy them into bench/results/ and commit them.
#   device: bash bench/run_all.sh
# (eight files come back from a device call: the read ceiling of the decode cases is its own call,
#  python3 -m bench.read_ceiling)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
timeout 150 python3 bench/prefill.py --seqs 1024 4096 16384 2>&1 | grep -v Warn | tee "$OUT/prefill_log.txt"
timeout 240 python3 bench/decode.py 2>&1 | grep -E "^dc_|wrote|Error" | tee "$OUT/decode_log.txt"
timeout 180 python3 bench/flex_ops.py --seqs 4096 16384 2>&1 | grep -E "^pf_|wrote|FAILED" | tee "$OUT/flex_log.txt"
timeout 90 python3 bench/overhead.py 2>&1 | grep -E "host_us|wrote|Error" | tee "$OUT/overhead_log.txt"
