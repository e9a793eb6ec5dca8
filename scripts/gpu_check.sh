#!/usr/bin/env bash
# The GPU check anyone with one CUDA GPU can run (its runs: docs/benchmarks/gpu-validate_*.md):
#   tests     the `gpu` tests (timing with CUDA events against a synchronised step);
#   validate  seven single-GPU plans of examples/gpt.py (350M and 1.3B parameters, several
#             micro-batch sizes, with and without recompute, one in tf32) and two of
#             examples/moe_gpt.py (8 experts, top 2: grouped_mm in bf16) planned with the
#             datasheet profile for eager stages (--no-compile) and run by `hetpar validate`;
#   loops     the 1.3B plan at micro-batch 8 against hand-written loops (eager AdamW,
#             fused AdamW, torch.compile with fused AdamW; benchmarks/gpu_loop_bench.py)
#             and the same plan for compiled stages (--compile), validated;
#             Also two plans of benchmarks/published/gpt.py with attention written out
#             (Megatron's 2022 CoreAttention), without and with selective recompute
#             (Korthikanti's: scores recomputed in backward), validated the same way;
#   hfflow    the Hugging Face path on this GPU: a Llama checkpoint written with
#             save_pretrained and a token file, `hetpar plan --hf`, compile, 5 steps from
#             the checkpoint on the file with --save-hf and a held-out loss, and from_pretrained of the result
#             (not among the default parts: GPU_CHECK_PARTS=hfflow);
#   profile   `hetpar profile` of this GPU;
#   repredict the plans predicted again with the measured profile;
# then one table of predicted against measured step times. GPU_CHECK_PARTS=a,b runs
# only those parts (the summary always), e.g. GPU_CHECK_PARTS=repredict on another host over a
# copied OUT_DIR; GPU_CHECK_CONFIGS=a,b only those plans (names as in CONFIGS below).
# Each part is time-boxed and writes under OUT_DIR as it
# goes, so a part that fails leaves the others' results.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default out/gpu_check; PY=python3 by default)
#   GPU_CHECK_SMOKE=1 scripts/gpu_check.sh  the same steps on this CPU with tiny models, a
#                                           quick one-worker profile and no loop bench:
#                                           checks the script itself in a minute or two
#
# hetpar runs from this checkout (PYTHONPATH), so nothing needs installing beyond
# torch, ortools, typer, rich and pytest.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=${1:-out/gpu_check}
PY=${PY:-python3}
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # a path stays valid after cd
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$REPO"
hetpar() { "$PY" -m hetpar "$@"; }
part() { echo; echo "== $* ($(date +%T))"; }

SMOKE=${GPU_CHECK_SMOKE:-0}
PARTS=,${GPU_CHECK_PARTS:-tests,validate,loops,profile,repredict},
want() { [[ $PARTS == *,$1,* ]]; }
M350=(-a n_layers=24 -a hidden=1024 -a heads=16 -a seq_len=1024 -a vocab=50304)
M1300=(-a n_layers=24 -a hidden=2048 -a heads=16 -a seq_len=1024 -a vocab=50304)
MOE=(-a n_layers=8 -a hidden=1024 -a heads=16 -a experts=8 -a top_k=2 -a ffn=2048 -a seq_len=1024 -a vocab=50304)
UNF=(-a n_layers=24 -a hidden=1024 -a heads=16 -a seq_len=2048 -a vocab=50304 -a attention=unfused -a dropout=0)
HF_LLAMA="hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000"
HF_SEQ=1024
PROFILE_OPTS=()
if [ "$SMOKE" = 1 ]; then
    M350=(-a n_layers=2 -a hidden=32 -a heads=4 -a seq_len=16 -a vocab=64)
    M1300=(-a n_layers=2 -a hidden=64 -a heads=4 -a seq_len=16 -a vocab=64)
    MOE=(-a n_layers=2 -a hidden=32 -a heads=4 -a experts=4 -a ffn=32 -a seq_len=16 -a vocab=64)
    UNF=(-a n_layers=2 -a hidden=32 -a heads=4 -a seq_len=16 -a vocab=64 -a attention=unfused -a dropout=0)
    HF_LLAMA="hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64"
    HF_SEQ=16
    PROFILE_OPTS=(--quick --nproc 1)
    CLUSTER=${CLUSTER:-1x1xcpu}
elif ! { want tests || want validate || want loops || want profile; }; then
    :  # re-prediction and the summary need no GPU
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY (GPU_CHECK_SMOKE=1 checks the script on a CPU)" >&2
    exit 1
else
    "$PY" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))" | tee "$OUT_DIR/device.txt"
fi
CLUSTER=${CLUSTER:-1x1xH200-141GB}

# name model micro-batch recompute [model file, default examples/gpt.py] [dtype, default the plan's: bf16 on GPUs]
# [one more plan option]; the global batch is two micro-batches. 1p3b_mb4_offload keeps the whole training state in
# host memory (ZeRO-3 over the one GPU, FSDP2's CPU offload with pinned memory): its host-link costs against the run
CONFIGS="350m_mb4_none M350 4 none
350m_mb16_none M350 16 none
350m_mb16_full M350 16 full
1p3b_mb4_none M1300 4 none
1p3b_mb8_none M1300 8 none
1p3b_mb8_full M1300 8 full
moe_mb4_none MOE 4 none examples/moe_gpt.py
moe_mb8_none MOE 8 none examples/moe_gpt.py
unfused_mb4_none UNF 4 none benchmarks/published/gpt.py
unfused_mb4_sel UNF 4 selective benchmarks/published/gpt.py
350m_mb8_tf32 M350 8 none examples/gpt.py tf32
1p3b_mb4_offload M1300 4 none examples/gpt.py bf16 --offload=on"

# GPU_CHECK_CONFIGS=a,b keeps only those configurations (e.g. 350m_mb4_none for a quick check)
if [ -n "${GPU_CHECK_CONFIGS:-}" ]; then
    CONFIGS=$(grep -E "^($(echo "$GPU_CHECK_CONFIGS" | tr , '|')) " <<<"$CONFIGS")
fi

# each_config FUNCTION: calls FUNCTION name plan-arguments... for each configuration
each_config() {
    while read -r name model mb recompute file dtype extra; do
        declare -n margs=$model
        "$1" "$name" "${file:-examples/gpt.py}" "${margs[@]}" -c "$CLUSTER" -b $((2 * mb)) --micro-batch-size "$mb" \
            --recompute "$recompute" --no-compile ${dtype:+--dtype "$dtype"} ${extra:+"$extra"}
        unset -n margs
    done <<<"$CONFIGS"
}

plan_and_validate() {
    local name=$1; shift
    part "$name: plan, validate"
    hetpar plan "$@" -o "$OUT_DIR/plan_$name.json" >/dev/null || return
    timeout 150 "$PY" -m hetpar validate "$OUT_DIR/plan_$name.json" --steps 6 --json >"$OUT_DIR/validate_$name.json" \
        2>"$OUT_DIR/validate_$name.log" || tail -n 3 "$OUT_DIR/validate_$name.log"
}

repredict() {
    local name=$1; shift
    hetpar plan "$@" --profile "$OUT_DIR/profile.json" -o "$OUT_DIR/plan_${name}_profiled.json" >/dev/null
}

if want tests; then
    part "gpu tests"
    timeout 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -n 15 | tee "$OUT_DIR/gpu_tests.log"
fi
want validate && each_config plan_and_validate
if want loops; then
    part "1.3B, micro-batch 8: hand-written loops and the compiled program"
    if [ "$SMOKE" != 1 ]; then
        timeout 200 "$PY" benchmarks/gpu_loop_bench.py examples/gpt.py "${M1300[@]}" --micro-batch-size 8 \
            --microbatches 2 | tee "$OUT_DIR/loops.jsonl"
    fi
    hetpar plan examples/gpt.py "${M1300[@]}" -c "$CLUSTER" -b 16 --micro-batch-size 8 --recompute none --compile \
        -o "$OUT_DIR/plan_1p3b_mb8_compiled.json" >/dev/null \
        && timeout 200 "$PY" -m hetpar validate "$OUT_DIR/plan_1p3b_mb8_compiled.json" --steps 6 --json \
            >"$OUT_DIR/validate_1p3b_mb8_compiled.json" 2>"$OUT_DIR/validate_1p3b_mb8_compiled.log" \
        || tail -n 3 "$OUT_DIR/validate_1p3b_mb8_compiled.log"
fi
if want hfflow; then
    part "Hugging Face checkpoint and token file: plan --hf, compile, train, --save-hf, from_pretrained"
    hf="$OUT_DIR/hfflow"
    rm -rf "$hf" && mkdir -p "$hf"
    "$PY" - "$hf" "$HF_LLAMA" "$HF_SEQ" <<'EOF' || echo "hfflow: could not write the checkpoint"
import sys
import numpy as np
import torch
import transformers as tf
out, fields, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
kwargs = {k.strip(): int(v) for k, v in (f.split("=") for f in fields.split(","))}
config = tf.LlamaConfig(**kwargs, max_position_embeddings=max(seq, 64))
torch.manual_seed(0)
tf.LlamaForCausalLM(config).save_pretrained(f"{out}/ckpt")
np.random.default_rng(0).integers(0, config.vocab_size, size=64 * (seq + 1) * 8, dtype=np.uint16).tofile(f"{out}/train.bin")
EOF
    { hetpar plan --hf "$hf/ckpt" --seq-len "$HF_SEQ" -c "$CLUSTER" -b 8 -o "$hf/plan.json" >/dev/null \
        && hetpar compile "$hf/plan.json" -o "$hf/build" >/dev/null \
        && (cd "$hf/build" && timeout 300 "$PY" train.py --steps 5 --init-from ../ckpt --data ../train.bin \
                --eval-data ../train.bin --eval-batches 2 --save-hf ../trained --metrics ../metrics.jsonl 2>&1 | tail -n 4) \
        && "$PY" -c "import sys, transformers as tf; m = tf.AutoModelForCausalLM.from_pretrained(sys.argv[1]); print('hfflow: from_pretrained loads', type(m).__name__)" "$hf/trained"; } \
        2>&1 | tee "$OUT_DIR/hfflow.log"
fi
if want profile; then
    part "hetpar profile -o $OUT_DIR/profile.json"
    timeout 240 "$PY" -m hetpar profile -o "$OUT_DIR/profile.json" "${PROFILE_OPTS[@]}" 2>&1 | tail -n 25 \
        | tee "$OUT_DIR/profile.log"
fi
if want repredict && [ -s "$OUT_DIR/profile.json" ]; then
    part "the plans predicted again with the measured profile"
    each_config repredict
fi

part "summary"
"$PY" - "$OUT_DIR" <<'EOF'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


rows, errors = [], {"datasheet": [], "profiled": []}
print(f"{'plan':18s} {'measured':>10s} {'datasheet':>10s} {'error':>7s} {'profiled':>10s} {'error':>7s}   fwd/bwd per micro-batch")
for plan in sorted(out.glob("plan_*.json")):
    name = plan.stem[len("plan_"):]
    if name.endswith("_profiled"):
        continue
    v = load(out / f"validate_{name}.json")
    if not v:
        print(f"{name:18s} {'failed':>10s}")
        continue
    measured = v["measured_step_time_s"]
    cells = [f"{measured * 1e3:8.1f}ms"]
    for kind, path in (("datasheet", plan), ("profiled", out / f"plan_{name}_profiled.json")):
        p = load(path)
        if p:
            predicted = p["predicted"]["step_time_s"]
            err = (predicted - measured) / measured
            errors[kind].append(abs(err))
            cells += [f"{predicted * 1e3:8.1f}ms", f"{err:+7.1%}"]
        else:
            cells += [f"{'-':>10s}", f"{'-':>7s}"]
    st = v.get("stages") or [{}]
    split = f"{st[0].get('measured_fwd_s', 0) * 1e3:.1f}/{st[0].get('measured_bwd_s', 0) * 1e3:.1f} ms"
    print(f"{name:18s} " + " ".join(cells) + f"   {split}")
for kind, errs in errors.items():
    if errs:
        print(f"{kind}: median |error| {statistics.median(errs):.1%}, worst {max(errs):.1%} over {len(errs)} plans")
loops = [json.loads(line) for line in (out / "loops.jsonl").read_text().splitlines()] if (out / "loops.jsonl").is_file() else []
generated = load(out / "validate_1p3b_mb8_none.json")
compiled = load(out / "validate_1p3b_mb8_compiled.json")
for loop in loops:
    ours = compiled if loop["variant"] == "compiled" else generated
    ratio = f"{ours['measured_step_time_s'] / loop['step_time_s']:.3f}x" if ours else "-"
    print(f"hand-written loop {loop['variant']:8s} {loop['step_time_s'] * 1e3:8.1f} ms; generated program / loop: {ratio}")
EOF
