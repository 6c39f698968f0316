#!/usr/bin/env bash
# Train the four default specialists on one GPU, in parallel: backbone, then drafter (backbone
# frozen), then export (bf16). Written for a 10-minute GPU lease: each phase has a wall-clock budget
# and the cosine schedule finishes within it.
#
#   bash specialists/train/ensemble_gpu.sh PACKED.tar.xz TOKENIZER_DIR OUT_DIR
#
# PACKED.tar.xz holds data/packed (python -m specialists.train pack); OUT_DIR receives <domain>.tar
# (the model directory) and logs.tar.gz. Env: BACKBONE_S (280), MTP_S (140), BATCH (32), MTP_BATCH (BATCH),
# CHAT_FRACTION (0.5), BACKBONE_LR (3e-3), INIT_DIR (continue from INIT_DIR/<domain>), DOMAINS, CANTATA_COMMIT.
set -euo pipefail
packed_tar=${1:?packed tarball}
tokenizer=${2:?tokenizer dir}
out=${3:?output dir}
backbone_s=${BACKBONE_S:-280}
mtp_s=${MTP_S:-140}
batch=${BATCH:-32}
chat_fraction=${CHAT_FRACTION:-0.5}
backbone_lr=${BACKBONE_LR:-3e-3}
mtp_batch=${MTP_BATCH:-$batch}
domains=${DOMAINS:-cpp python build shell}
export PYTHONUNBUFFERED=1
mkdir -p data runs/logs "$out"
tar -C data -xJf "$packed_tar"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
common=(--data data/packed --steps 1000000 --seq-len 1024 --chat-fraction "$chat_fraction" --eval-every 1000 --save-every 2000)
for d in $domains; do
  (
    init=(); [ -n "${INIT_DIR:-}" ] && init=(--init-from "$INIT_DIR/$d")
    python3 -m specialists.train backbone --domain "$d" --tokenizer "$tokenizer" --out "runs/$d" \
      --time-budget-s "$backbone_s" --lr "$backbone_lr" --warmup 200 --batch-size "$batch" "${init[@]}" "${common[@]}" &&
    python3 -m specialists.train mtp --domain "$d" --out "runs/$d" --k 3 \
      --time-budget-s "$mtp_s" --lr 2e-3 --warmup 100 --batch-size "$mtp_batch" "${common[@]}" &&
    python3 -m specialists.train export --run "runs/$d" --tokenizer "$tokenizer" --packed data/packed \
      --out "runs/export/$d" &&
    tar -C runs/export -cf "$out/$d.tar" "$d"
  ) > "runs/logs/$d.log" 2>&1 &
done
status=0
wait || status=$?
for d in $domains; do
  echo "== $d"; grep -E '^\{|Error|error|sanity' "runs/logs/$d.log" | cut -c1-400 || true
  for f in "runs/$d"/*_result.json; do [ -f "$f" ] && cp "$f" "runs/logs/${d}_$(basename "$f")"; done
done
tar -C runs -czf "$out/logs.tar.gz" logs
ls -la "$out"
exit $status
