#!/bin/bash
# bash tools/device/gpu_smoke.sh [OUT_DIR]   (DEVICE=cpu PY=.venv/bin/python to try it here, ~40 s)
#
# One-rank jobs of 3 steps each on DEVICE (default cuda) through the paths the default job does not
# take: multi-turn tool calls, DAPO's dynamic sampling and overlong shaping, a reward model with
# ReMax baselines and chunked rollouts, GRPO with the KL penalty in the reward, packed token-budget
# micro-batches in bf16, LoRA adapters on the policy and the value model in bf16 (the adapter-only sync,
# the reference as the base). A tensor left on the wrong device, or a CPU-only call, shows here first.
# One line per job: its exit code, its time and its step 3; each job's log in OUT_DIR.
# DEADLINE (seconds since the epoch, set by tools/device/device_check.sh): nothing runs past it, the
# kill grace (GRACE seconds, default 10) of each job's timeout included; a job it stops or leaves
# unstarted says rc=124.
DEV=${DEVICE:-cuda}; PY=${PY:-python3}; OUT_DIR=${1:-outputs/gpu_smoke}; mkdir -p "$OUT_DIR"; GRACE=${GRACE:-10}
# limit CAP: seconds a command may run from now, its kill grace inside DEADLINE (CAP without one).
limit() { local l=$1; [ -n "${DEADLINE:-}" ] && l=$(( DEADLINE - $(date +%s) - GRACE < l ? DEADLINE - $(date +%s) - GRACE : l )); echo "$l"; }
t=$(limit 120); [ "$t" -gt 5 ] || { echo "not run: past DEADLINE"; exit 124; }
RM=$(timeout -k "$GRACE" "$t" $PY -c "from spmdsplit.embedded import ensure_embedded_model as e; print(e())") || exit 1
ONE_POOL=(placement.mode=custom 'placement.pools={train: 1}' 'placement.roles={rollout: train, actor: train}'
          rollout.staleness=0)  # the presets' rollout pool folded onto the one rank
run() {
    local name=$1 t0=$SECONDS t; shift
    t=$(limit 300)
    if [ "$t" -le 5 ]; then echo "$name: rc=124 in 0s | not run: past DEADLINE"; return; fi
    timeout -k "$GRACE" "$t" "$PY" -m torch.distributed.run --nproc-per-node 1 -m spmdsplit.train placement.mode=colocate \
        placement.pools=[] trainer.device="$DEV" trainer.total_steps=3 trainer.resume=disable trainer.save_freq=-1 \
        trainer.output_dir= trainer.progress_bar=false trainer.default_local_dir="$OUT_DIR/$name/ckpt" \
        trainer.log_dir="$OUT_DIR/$name/tb" trainer.timeline="$OUT_DIR/$name/timeline.json" "$@" \
        >"$OUT_DIR/$name.log" 2>&1
    local rc=$? why=""
    # A timeout at the job's own cap is a failure (rc 1); one the DEADLINE set stays 124, a cut.
    if { [ $rc = 124 ] || [ $rc = 137 ]; }; then
        if [ "$t" -ge 300 ]; then rc=1; why=" (timed out at its 300 s cap)"; else rc=124; fi
    fi
    echo "$name: rc=$rc in $((SECONDS - t0))s$why | $(grep -E '^step 3:' "$OUT_DIR/$name.log" | head -1)"
    [ $rc = 0 ] || grep -E "error|Error" "$OUT_DIR/$name.log" | tail -4
}
run agent --config configs/agent_lookup.yaml
run dapo --config configs/dapo_rollout_actor.yaml "${ONE_POOL[@]}" data.train_batch_size=16 actor.ppo_mini_batch_size=16
run remax_rm algorithm.adv_estimator=remax rollout.n=2 reward.model.path="$RM" reward.model.micro_batch_size_per_gpu=8 \
    rollout.stream_chunks=2 data.train_batch_size=8 actor.ppo_mini_batch_size=8 critic.ppo_mini_batch_size=8 \
    trainer.val_freq=3
run grpo_kl --config configs/grpo_rollout_actor.yaml "${ONE_POOL[@]}" algorithm.use_kl_in_reward=true
run packed model.use_remove_padding=true actor.use_dynamic_bsz=true critic.use_dynamic_bsz=true \
    actor.ppo_max_token_len_per_gpu=512 critic.ppo_max_token_len_per_gpu=512 model.dtype=bfloat16
run lora model.lora_rank=8 critic.model.lora_rank=8 model.dtype=bfloat16 model.gradient_checkpointing=true \
    trainer.save_freq=3
