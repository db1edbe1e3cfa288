#!/usr/bin/env bash
# The speculative-decoding benchmark's pair, trained from scratch on the Python standard library's
# own sources (every machine has them): a ~46M-parameter target (fp32: ~175 MiB, too large to ship
# in models/), a ~4M-parameter draft with its tokenizer, and an EAGLE-3 head for the target
# (`kvserve train-eagle`, at most 25 minutes). About two hours on a 2-core CPU.
#
#   bash scripts/build_speculative_pair.sh [OUT_DIR]      # default: ../spec-pair beside the checkout
#   python benchmarks/bench_speculative.py --target OUT_DIR/stdlib-target --draft OUT_DIR/stdlib-draft \
#       --eagle3 OUT_DIR/stdlib-eagle3
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-../spec-pair}
corpus="$HOME/.cache/kvserve/python$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')-stdlib.txt"
common=(--corpus stdlib --seq-len 256 --precision fp32 --eval-every 100 --eval-batches 10
        --warmup-steps 30)
python scripts/train_tiny.py --out "$out/stdlib-target" --preset stdlib-target --vocab-size 4096 \
  --max-minutes 55 "${common[@]}"
python scripts/train_tiny.py --out "$out/stdlib-draft" --preset stdlib-draft \
  --tokenizer "$out/stdlib-target" --max-minutes 9 "${common[@]}"
card=(--corpus "$corpus" --max-tokens 16384 --prompt "def ")
python scripts/write_model_card.py --model "$out/stdlib-target" "${card[@]}"
python scripts/write_model_card.py --model "$out/stdlib-draft" --target "$out/stdlib-target" \
  "${card[@]}"
python -m kvserve train-eagle --target "$out/stdlib-target" --corpus "$corpus" \
  --out "$out/stdlib-eagle3" --max-minutes 25
