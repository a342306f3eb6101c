#!/usr/bin/env bash
# The main job: trains a small Qwen3.5 hybrid (3 GDN + 1 full attention layers) under FSDP+CP4 on real text
# (Python stdlib sources as bytes). No GPU: 4 self-spawned CPU ranks over gloo; with 4 GPUs: torchrun/NCCL.
# Extra arguments go to the trainer, e.g. --set train.steps=50 or --set train.accelerator.linear_attention_cp_mode=ulysses
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/train.sh" "$@"
