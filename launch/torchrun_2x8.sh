#!/bin/bash
# The job on 2 nodes x 8 GPUs with torchrun, without Slurm: run this same line on both nodes, from
# the repository root, in the environment where spmdsplit is installed.
#
#   HEAD=node0.cluster bash launch/torchrun_2x8.sh --config configs/gpu_qwen2.5_0.5b.yaml \
#       trainer.default_local_dir=/shared/runs/ppo-1/checkpoints trainer.log_dir=/shared/runs/ppo-1/tensorboard
#
# HEAD: an address of the first node that both nodes reach; torchrun's c10d rendezvous runs there
# (PORT, default 29500) and waits until both nodes have joined. RDZV_ID names the job: the same on
# both nodes, a new one for each job. Everything after the script's name goes to spmdsplit.train.
#
# The layout (docs/placement.md): by default (placement.mode=split) the 8 GPUs of node rank 0 (as
# the rendezvous numbers the nodes) are the actor pool and node rank 1's the critic pool
# (configs/nodes_8+8.yaml spells that out); add
# `--config configs/custom_6+2_per_node.yaml` for 6 actor + 2 critic ranks on every node.
#
# Both nodes read the same model and data paths and write checkpoints where a resumed job finds
# them: put them on a filesystem both see (docs/troubleshooting.md#model-cache-and-offline-runs).
# A node with several network interfaces may need NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME
# exported before this script (docs/troubleshooting.md). One rank that fails ends the whole job.
set -euo pipefail
: "${HEAD:?set HEAD to the address of the first node}"
exec "${TORCHRUN:-torchrun}" --nnodes 2 --nproc-per-node 8 \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:${PORT:-29500}" --rdzv-id "${RDZV_ID:-spmdsplit}" \
    -m spmdsplit.train "$@"
