#!/usr/bin/env bash
# The training job. With at least NPROC GPUs: torchrun (NCCL, one process per GPU); otherwise NPROC
# self-spawned gloo CPU ranks. Extra arguments go to the trainer (e.g. --set train.steps=50).
#   scripts/train.sh                                  # configs/tiny_cp4.yaml at CP4
#   CONFIG=configs/gpu_h200.yaml NPROC=1 scripts/train.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
CONFIG=${CONFIG:-configs/tiny_cp4.yaml}
NPROC=${NPROC:-4}
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge "$NPROC" ] && [ "$GPUS" -gt 0 ]; then
  exec torchrun --standalone --nproc-per-node "$NPROC" -m deltacp.train --config "$CONFIG" \
    --set train.accelerator.cp="$NPROC" "$@"
fi
exec python -m deltacp.train --config "$CONFIG" --spawn "$NPROC" --set train.accelerator.cp="$NPROC" "$@"
