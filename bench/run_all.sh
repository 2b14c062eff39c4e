#!/usr/bin/env bash
# The benchmark of DESIGN.md section 5 and beyond on the device: `neptune-fusion bench` from this
# checkout (arguments pass through; see `python3 -m neptune_fusion bench --help`). One folder per run:
# $OUT on the device, else bench/results/<date>-<n>. FlashAttention-4 and FlexAttention's FLASH
# backend join when importable (../shared/tools/fa4-baseline.sh puts them on PYTHONPATH).
#   device: bash bench/run_all.sh --suite decode
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 -m neptune_fusion bench "$@"
