#!/bin/bash
# bash tools/device/device_check.sh [OUT_DIR]   (default outputs/device_check)
#   DEVICE=cpu PY=.venv/bin/python bash tools/device/device_check.sh /tmp/devcheck   the same steps on CPU
#
# The device checks of a lent one-GPU machine, as one prepared script (issue 49 item 9), run from the
# repository root of a copy of the working tree. That machine has torch, transformers, peft, ... but
# not omegaconf or submitit, and no network: `bash tools/setup/device_wheels.sh` fills .whl/ here, the
# folder travels with the tree (the device tool's carry: [".whl"]) and is installed first into
# $SITE with no index. Then, in sequence, each under a timeout and all within BUDGET seconds
# (default 470 on cuda: under 8 minutes), the deps step and every key number's reading included:
# each step ends, its kill grace counted, early enough for its reading to end by the deadline:
#   deps        every runtime import of pyproject.toml, and where omegaconf and submitit come from
#   gpu_check   python -m tools.device.gpu_check, HF rollout only (no vLLM there), at configs/gpu_qwen2.5_0.5b.yaml's
#               own batching: its token budgets (use_dynamic_bsz, *_max_token_len_per_gpu), packed passes
#               (use_remove_padding) and attention (auto: varlen without flash-attn), on Qwen2.5-0.5B's
#               shape, 4 steps, the last profiled: the step time and MFU per phase (tools/plan/efficiency.py)
#   lora_resume configs/lora_grpo_rollout_actor.yaml on one rank (its rollout pool folded onto it), bf16:
#               4 steps saving at steps 2 and 4, then a run resumed from global_step_2, which must say it
#               resumes at step 3 and log steps 3 and 4 only; the checkpoint must hold adapters only
#   continuous  python -m tools.device.continuous_check: continuous generation (rollout.continuous) with the HF
#               engine, weights taken mid-answer, every token's log-prob checked against its version
#   smoke       bash tools/device/gpu_smoke.sh: the paths the default job does not take, 3 steps each
# and prints one table: check | result | rc | seconds | key number (also OUT_DIR/device_check.md).
# result: ok, FAILED (a non-zero exit, or the step's own time cap reached), or "cut by the budget"
# (not started for want of time, or stopped where the budget, not its cap, was its limit). Exit code
# 1 if any check failed, else 2 if the budget cut one, else 0. DEVICE=cpu: the same steps on CPU
# (gpu_check on its --small shape, 3 steps instead of 4). ONLY="lora_resume smoke": deps and those
# checks alone (a rerun of what the budget cut).
DEV=${DEVICE:-cuda}; PY=${PY:-python3}; OUT_DIR=${1:-outputs/device_check}
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO" || exit 1
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
if [ "$DEV" = cuda ]; then BUDGET=${BUDGET:-470}; else BUDGET=${BUDGET:-1800}; fi
T0=$(date +%s); DEADLINE=$((T0 + BUDGET)); export DEVICE=$DEV PY
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # the machine has no network; nothing here needs it
ROWS=(); FAILED=0; CUT=0
GRACE=5      # seconds `timeout` waits after its TERM before a KILL
READ_S=20    # what each step keeps back for reading its key number (a python that imports torch)

left() { local l=$((DEADLINE - $(date +%s))); if [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi; }
# bounded SECS CMD...: CMD under min(SECS, the budget left), its kill grace inside that too.
bounded() {
    local t; t=$(( $(left "$1") - GRACE )); shift
    if [ "$t" -le 0 ]; then return 124; fi
    timeout -k "$GRACE" "$t" "$@"
}
# run_step NAME CAP LOG CMD...: CMD under min(CAP, what the budget leaves once the kill grace and
# the key's reading are kept back) seconds; sets RC, SECS and HOW (ok | failed | cut).
run_step() {
    local name=$1 cap=$2 log=$3 t t0=$SECONDS; shift 3
    t=$(( $(left $((cap + GRACE + READ_S))) - GRACE - READ_S ))
    if [ "$t" -lt 10 ]; then
        RC=124; SECS=0; HOW=cut; echo "not run: the budget of ${BUDGET}s is spent" >"$log"; return
    fi
    echo "device_check: $name (at most ${t}s; log $log)" >&2
    timeout -k "$GRACE" "$t" "$@" >"$log" 2>&1; RC=$?; SECS=$((SECONDS - t0))
    verdict "$RC" "$t" "$cap"
    [ "$RC" = 0 ] || tail -n 6 "$log" | sed "s/^/  $name | /" >&2
}
# verdict RC LIMIT CAP: HOW for a step that exited RC under LIMIT seconds of its CAP: a timeout
# (124, or 137 after the KILL) where the budget set the limit is the budget's cut, not a failure.
verdict() {
    if [ "$1" = 0 ]; then HOW=ok
    elif { [ "$1" = 124 ] || [ "$1" = 137 ]; } && [ "$2" -lt "$3" ]; then HOW=cut
    else HOW=failed; fi
}
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }  # ONLY="lora_resume smoke": those checks alone
row() {  # NAME HOW RC SECONDS KEY
    local result=ok
    case $2 in failed) result=FAILED; FAILED=1 ;; cut) result="cut by the budget"; CUT=1 ;; esac
    ROWS+=("| $1 | $result | $3 | $4 | $5 |")
    echo "device_check: $1: $result, rc=$3 in $4s | $5" >&2
}

# ---- deps: the wheels of .whl/ installed into SITE, then every runtime import
SITE=${SITE:-/tmp/spmdsplit-device-site}; t0=$SECONDS; how="installed"; DEPS_CAP=90; DEPS_END=$((T0 + DEPS_CAP))
deps_left() { local l=$((DEPS_END - $(date +%s))); echo $(( l < 1 ? 1 : l )); }  # the deps step's own cap
if ls .whl/*.whl >/dev/null 2>&1; then
    rm -rf "$SITE" && mkdir -p "$SITE"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        bounded "$(deps_left)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl >"$OUT_DIR/deps_install.log" 2>&1
    else  # pure-Python wheels are zip files laid out as site-packages
        for w in .whl/*.whl; do bounded "$(deps_left)" "$PY" -m zipfile -e "$w" "$SITE"; done
    fi
    how="from .whl"
    export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
KEY=$(bounded "$(deps_left)" "$PY" - "$DEV" "$how" 2>"$OUT_DIR/deps.log" <<'EOF'
import importlib, importlib.metadata as md, os, sys
mods = ["torch", "transformers", "omegaconf", "tensorboard", "submitit", "pyarrow", "tqdm", "numpy", "packaging",
        "peft", "yaml", "safetensors"]
missing = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        missing.append(f"{m} ({type(e).__name__})")
import torch
gpu = torch.cuda.get_device_name() if sys.argv[1] == "cuda" and torch.cuda.is_available() else "cpu"
if sys.argv[1] == "cuda" and gpu == "cpu":
    missing.append("a CUDA device")
where = {os.path.dirname(os.path.dirname(importlib.import_module(m).__file__)) for m in ("omegaconf", "submitit")}
line = (f"torch {torch.__version__} on {gpu}; omegaconf {md.version('omegaconf')}, submitit {md.version('submitit')} "
        f"{sys.argv[2]} ({', '.join(sorted(where))})")
print(line + (f"; MISSING: {', '.join(missing)}" if missing else ""))
sys.exit(1 if missing else 0)
EOF
); RC=$?; verdict "$RC" $(( DEPS_CAP < BUDGET ? DEPS_CAP : BUDGET )) "$DEPS_CAP"
row deps "$HOW" "$RC" $((SECONDS - t0)) "${KEY:-$(tail -n 1 "$OUT_DIR/deps.log")}"

# ---- gpu_check at the 0.5B preset's own batching
if want gpu_check; then
mapfile -t BATCHING < <(bounded 15 "$PY" - <<'EOF'
import yaml
preset = yaml.safe_load(open("configs/gpu_qwen2.5_0.5b.yaml"))
for section in ("model", "actor", "critic", "ref"):
    for key, value in (preset.get(section) or {}).items():
        if key in ("use_remove_padding", "attn_implementation", "use_dynamic_bsz") or "max_token_len" in key:
            print(f"{section}.{key}={str(value).lower() if isinstance(value, bool) else value}")
EOF
)
if [ "$DEV" = cuda ]; then CHECK=(--steps 4); else CHECK=(--steps 3 --small); fi
run_step gpu_check 300 "$OUT_DIR/gpu_check.log" "$PY" -m tools.device.gpu_check --device "$DEV" --rollouts hf "${CHECK[@]}" \
    --out "$OUT_DIR/gpu_check" "${BATCHING[@]}"
KEY=$(bounded "$READ_S" "$PY" - "$OUT_DIR/gpu_check/gpu_check.json" "$DEV" "${BATCHING[@]}" <<'EOF' 2>/dev/null
import json, sys
from spmdsplit.models import attention_implementation
r = json.load(open(sys.argv[1]))
o = dict(a.split("=", 1) for a in sys.argv[3:])
hf = r["rollouts"]["hf"]
phases = r.get("efficiency", {}).get("hf", {}).get("phases", {})
mfu = ", ".join(f"{name} {p['mfu']:.1%}" for name, p in phases.items() if p.get("mfu") is not None)
print(f"step {hf['step_s']:.2f} s, peak {hf['peak_mb']:.0f} MB; MFU {mfu or 'n/a'}; token budgets actor "
      f"{o['actor.ppo_max_token_len_per_gpu']}/{o['actor.log_prob_max_token_len_per_gpu']}, critic "
      f"{o['critic.ppo_max_token_len_per_gpu']}/{o['critic.forward_max_token_len_per_gpu']}, packed "
      f"{o['model.use_remove_padding']}, attention {attention_implementation(o['model.attn_implementation'], sys.argv[2])}")
EOF
)
row gpu_check "$HOW" "$RC" "$SECS" "${KEY:-n/a}"
fi

# ---- LoRA, an adapter-only checkpoint and a resume from it
if want lora_resume; then
LORA_DIR=$OUT_DIR/lora; rm -rf "$LORA_DIR"; mkdir -p "$LORA_DIR"
TRAIN=("$PY" -m torch.distributed.run --nproc-per-node 1 -m spmdsplit.train --config configs/lora_grpo_rollout_actor.yaml
       placement.mode=custom placement.pools=[] 'placement.pools={train: 1}' 'placement.roles={rollout: train, actor: train}'
       rollout.staleness=0 trainer.device="$DEV" model.dtype=bfloat16 model.gradient_checkpointing=true
       trainer.total_steps=4 trainer.output_dir= trainer.progress_bar=false trainer.timeline=)
run_step lora_save 150 "$LORA_DIR/first.log" "${TRAIN[@]}" trainer.save_freq=2 trainer.resume=disable \
    trainer.default_local_dir="$LORA_DIR/ckpt" trainer.log_dir="$LORA_DIR/tb1"
RC1=$RC; SECS1=$SECS; HOW1=$HOW
if [ "$RC1" = 0 ]; then
    run_step lora_resume 150 "$LORA_DIR/resumed.log" "${TRAIN[@]}" trainer.save_freq=-1 \
        trainer.resume="$LORA_DIR/ckpt/global_step_2" trainer.default_local_dir="$LORA_DIR/ckpt2" trainer.log_dir="$LORA_DIR/tb2"
    RC2=$RC; SECS2=$SECS; HOW2=$HOW
else
    RC2=1; SECS2=0; HOW2=$HOW1
fi
KEY=$(bounded "$READ_S" "$PY" - "$LORA_DIR" "$RC1" "$RC2" <<'EOF' 2>&1
import glob, os, re, sys
import torch.distributed.checkpoint as dcp
from spmdsplit import lora
out, rc1, rc2 = sys.argv[1], *map(int, sys.argv[2:])
if rc1:
    print(f"first run rc={rc1}: " + open(os.path.join(out, "first.log")).read().strip().splitlines()[-1][:160]); sys.exit(1)
first = open(os.path.join(out, "first.log")).read()
sizes = re.findall(r"checkpoint of step (\d+) written to \S+ \(([\d.]+) MB\)", first)
problems, tensors = [], 0
if [s for s, _ in sizes] != ["2", "4"]:
    problems.append(f"checkpoints {sizes}, expected steps 2 and 4")
for engine in glob.glob(os.path.join(out, "ckpt", "global_step_2", "*", "engine")):
    saved = dcp.FileSystemReader(engine).read_metadata()
    weights = [k.removeprefix("model.") for k in saved.state_dict_metadata if k.startswith("model.")]
    tensors += len(weights)
    if not weights or not all(lora.is_adapter(k) or ".modules_to_save." in k for k in weights):
        problems.append(f"{engine}: not adapter-only ({[k for k in weights if not lora.is_adapter(k)][:3]})")
if not tensors:
    problems.append("no engine checkpoint under global_step_2")
if rc2:
    problems.append(f"resumed run rc={rc2}")
    print("; ".join(problems)); sys.exit(1)
resumed = open(os.path.join(out, "resumed.log")).read()
if not re.search(r"resuming from \S+global_step_2 at step 3", resumed):
    problems.append("the resumed run does not say it resumes from global_step_2 at step 3")
steps = [int(s) for s in re.findall(r"^step (\d+):", resumed, re.M)]
if steps != [3, 4]:
    problems.append(f"the resumed run logged steps {steps}, expected [3, 4]")
def lines(text):  # a step's console line less its time
    return {int(m.group(1)): re.sub(r"\s+step=\S+", "", m.group(2)) for m in re.finditer(r"^step (\d+):(.*)$", text, re.M)}
same = all(lines(first).get(s) == lines(resumed).get(s) for s in (3, 4))
mb = dict(sizes).get("2", "?")
print(f"checkpoint of step 2: {mb} MB, {tensors} adapter tensors only; resumed at step 3, logged {steps}; "
      f"steps 3-4 {'equal to' if same else 'differ from'} the saved run's" + (f"; FAILED: {'; '.join(problems)}" if problems else ""))
sys.exit(1 if problems else 0)
EOF
); RC=$?
# The runs' verdict first (a run the budget cut is a cut, whatever the reading then found).
if [ "$HOW1" != ok ]; then HOW=$HOW1; elif [ "$HOW2" != ok ]; then HOW=$HOW2; else verdict "$RC" 0 0; fi
row lora_resume "$HOW" "$RC" $((SECS1 + SECS2)) "$(echo "$KEY" | tail -n 1)"
fi

# ---- continuous generation with the HF engine
if want continuous; then
run_step continuous 120 "$OUT_DIR/continuous.log" "$PY" -m tools.device.continuous_check --device "$DEV" --out "$OUT_DIR/continuous"
KEY=$(bounded "$READ_S" "$PY" - "$OUT_DIR/continuous/continuous_check.json" <<'EOF' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['tokens_per_s']:.0f} tokens/s, occupancy {r['occupancy']:.1f}, {r['mixed_rows']} rows span two versions, "
      f"staleness max {r['staleness_max']}, max dlogp {r['logprob_diff_max']:.1e}" + (" (FAILED)" if r["problems"] else ""))
EOF
)
row continuous "$HOW" "$RC" "$SECS" "${KEY:-$(tail -n 1 "$OUT_DIR/continuous.log")}"
fi

# ---- the smoke jobs (each stops by the DEADLINE it is given, its kill grace inside; the outer
# timeout only backs that up)
if want smoke; then
t0=$SECONDS; SMOKE_END=$((DEADLINE - GRACE))
if [ $((SMOKE_END - $(date +%s))) -ge 10 ]; then
    DEADLINE=$SMOKE_END GRACE=$GRACE timeout -k "$GRACE" $((SMOKE_END - $(date +%s))) \
        bash tools/device/gpu_smoke.sh "$OUT_DIR/smoke" >"$OUT_DIR/smoke.log" 2>&1
    SMOKE_RC=$?
else
    SMOKE_RC=124; echo "not run: the budget of ${BUDGET}s is spent" >"$OUT_DIR/smoke.log"
fi
cat "$OUT_DIR/smoke.log" >&2
ok=$(grep -c ": rc=0 in" "$OUT_DIR/smoke.log"); all=$(grep -cE "^[a-z_]+: rc=[0-9]+ in" "$OUT_DIR/smoke.log")
failed=$(grep -E "^[a-z_]+: rc=[0-9]+ in" "$OUT_DIR/smoke.log" | grep -vcE ": rc=(0|124) in")
# A job the deadline stopped or left unstarted says rc=124; any other non-zero exit is a failure.
if [ "$failed" -gt 0 ]; then HOW=failed; RC=1
elif [ "$all" = 6 ] && [ "$ok" = 6 ]; then HOW=ok; RC=0
elif [ "$SMOKE_RC" = 124 ] || [ "$SMOKE_RC" = 137 ] || grep -q ": rc=124 in" "$OUT_DIR/smoke.log"; then HOW=cut; RC=124
else HOW=failed; RC=$SMOKE_RC; fi
KEY="$ok/6 jobs rc=0: $(grep -oE "^[a-z_]+: rc=[0-9]+ in [0-9]+s" "$OUT_DIR/smoke.log" | sed -E 's/: rc=0 in / /; s/: rc=([0-9]+) in / rc=\1 /' | paste -sd, - | sed 's/,/, /g')"
row smoke "$HOW" "$RC" $((SECONDS - t0)) "$KEY"
fi

TABLE=$(printf '%s\n' "| check | result | rc | seconds | key number |" "|---|---|---|---|---|" "${ROWS[@]}")
TOTAL=$(( $(date +%s) - T0 ))
printf '%s\n\n%s\n' "Device checks on $DEV, $(date -u +%Y-%m-%dT%H:%MZ): ${TOTAL} s of a ${BUDGET} s budget" "$TABLE" \
    | tee "$OUT_DIR/device_check.md"
if [ "$FAILED" = 1 ]; then exit 1; elif [ "$CUT" = 1 ]; then exit 2; fi
exit 0
