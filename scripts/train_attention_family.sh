#!/usr/bin/env bash
# Trains the attention family: one shape (4 layers, hidden 192, 8 query heads of 24, SwiGLU 512),
# one corpus and tokenizer (Tiny Shakespeare, BPE 1024), one budget (1200 steps of 8 x 256
# tokens, seed 1337), differing only in attention; then measures each and writes its model card.
#   MHA (8 KV heads), GQA 4:1 (2), MQA (1), MLA (latent 48 + RoPE key 8: 48 + 8 = 56 entries per
#   token and layer against MHA's 384), sliding window 64 on every layer, hybrid (one global
#   layer in 2, window 64), cross-layer KV sharing (factor 2) on GQA and on MQA, and two without
#   attention in some or all layers: ssm (a Mamba2 mixer in every layer: 8 heads of 48, 32 states;
#   a Granite 4 hybrid without attention layers) and ssm-hybrid (GQA 4:1 in one layer of 2).
# bf16 weights keep the shipped family small. About 3.5 minutes per attention member on 2 cores,
# 15 per state-space member.
#     bash scripts/train_attention_family.sh [OUT_DIR (models/attention)] [member ...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-models/attention}
shift || true
members=("$@")
[ ${#members[@]} -gt 0 ] || members=(mha gqa mqa mla sliding hybrid cla-gqa cla-mqa ssm ssm-hybrid)
[ "${members[0]}" = mha ] || [ -f "$out/mha/tokenizer.json" ] || {
  echo "train mha first: it trains the family's tokenizer" >&2; exit 1; }
shape=(--hidden-size 192 --num-hidden-layers 4 --num-attention-heads 8 --intermediate-size 512
       --steps 1200 --batch-size 8 --lr 2e-3 --seq-len 256 --warmup-steps 60 --eval-every 100
       --eval-batches 16 --dropout 0.0 --save-dtype bfloat16 --sliding-window 64
       --global-every 2 --kv-lora-rank 48 --rope-head-dim 8)
for member in "${members[@]}"; do
  case $member in
    cla-gqa) design=(--attention gqa --kv-sharing 2) ;;
    cla-mqa) design=(--attention mqa --kv-sharing 2) ;;
    # transformers' reference Mamba2 scan (mamba_ssm absent) runs 9x slower under bf16 autocast
    # on a CPU without bf16 instructions: the state-space members train in fp32 (~0.7 s a step).
    ssm | ssm-hybrid) design=(--attention "$member" --precision fp32) ;;
    *) design=(--attention "$member") ;;
  esac
  # mha trains the tokenizer; every other member reuses it.
  tokenizer=()
  [ "$member" = mha ] || tokenizer=(--tokenizer "$out/mha")
  python scripts/train_tiny.py --out "$out/$member" "${shape[@]}" "${design[@]}" "${tokenizer[@]}"
  python scripts/write_model_card.py --model "$out/$member"
done
