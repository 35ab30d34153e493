#!/usr/bin/env bash
# One prepared script for a machine with a GPU, in parts, most important first: correctness on CUDA (tests),
# the fast recipe (fast: its checkpoint then checked for causality and sampled; eager: uncompiled), nanoGPT
# side by side (nanogpt), the GPU training run on the from-scratch attention with sdpa's step time beside it
# (baby), the KV-cache benchmarks (kv), the fast recipe with a sliding window (window), and a compiled run
# stopped by timeout's SIGTERM (signals); every figure written as JSON/text to one folder.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]            # the bundled Tiny Shakespeare, or SHAKESPEARE=FILE
#   BUDGET_S=540 ...                                  # stop after 540 s, skipping what is left
#   PARTS="tests fast" ...                            # only these parts, of: tests fast eager baby kv window nanogpt signals
#   NANOGPT=PATH ...                                  # with part nanogpt: a nanoGPT checkout whose data/shakespeare_char
#                                                     # is prepared (its prepare.py on the same input.txt); the device
#                                                     # tool carries it from an ignored folder such as out/nanogpt
#   DRY=1 bash benchmarks/gpu_check.sh [OUT_DIR]      # CPU, small sizes: checks the script works
#
# OUT_DIR defaults to $OUT (set by the device tool) or out/gpu_check. Needs PyTorch, numpy, tqdm,
# tensorboard and pytest; no network (the corpus is corpora/tinyshakespeare.txt, or a synthetic one in
# dry mode). On one H200: the parts of its first version 520 s; PARTS="tests fast nanogpt" 554 s (2026-12-04).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-out/gpu_check}}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/log.txt"
: > "$LOG"
export PYTHONUNBUFFERED=1
status=0
step() { echo "== $*" | tee -a "$LOG"; }
PARTS=${PARTS:-"tests fast eager baby kv window $([ -n "${NANOGPT:-}" ] && echo nanogpt) signals"}
want() { [[ " $PARTS " == *" $1 "* ]]; }  # PART: is it to run?

if [ "${DRY:-0}" = "1" ]; then
    DEVICE=cpu
    DATA="$(mktemp -d)/dry_corpus.txt"  # outside OUT_DIR: only figures come back
    python - "$DATA" <<'EOF'
import random, sys
random.seed(0)
words = "the king and queen of love shall speak to thee my lord what is this night".split()
open(sys.argv[1], "w").write(" ".join(random.choice(words) for _ in range(20000)) + "\n")
EOF
    TRAIN_ARGS=(--max_iters=30 --eval_interval=10 --eval_iters=2 --n_layer=2 --n_head=2 --n_embd=64
                --block_size=64 --batch_size=8 --compile=false)
    KV_ARGS=(--small --repeats=1 --new_tokens=150 --slide=16)  # past the 64-token block: the sliding window too
else
    DEVICE=cuda
    DATA=${SHAKESPEARE:-corpora/tinyshakespeare.txt}
    TRAIN_ARGS=()
    KV_ARGS=(--repeats=3)
fi

step "machine"
{ nvidia-smi || echo "nvidia-smi not available"; } > "$OUT_DIR/nvidia-smi.txt" 2>&1
python - > "$OUT_DIR/env.json" <<'EOF'
import json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "threads": torch.get_num_threads()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["bf16"] = torch.cuda.is_bf16_supported()
print(json.dumps(info, indent=2))
EOF
cat "$OUT_DIR/env.json" | tee -a "$LOG"

# BUDGET_S: every command from here on stops once the script has run that long, and what is left is skipped;
# the steps run most important first, so a short lease still brings back the CUDA tests and the fast run.
DEADLINE=$((SECONDS + ${BUDGET_S:-100000}))
exec 3>&1  # capped reports here, to the terminal and the log, whatever its command's output is redirected to
capped() {  # COMMAND...: run it in the time left, or skip it
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -le 10 ]; then
        echo "skipped (BUDGET_S spent): $*" | tee -a "$LOG" >&3
        status=1
        return 1
    fi
    timeout "$left" "$@" || { echo "failed or out of time (rc $?): $*" | tee -a "$LOG" >&3; status=1; return 1; }
}

if want tests; then
    step "attention equivalence and causality tests on $DEVICE"
    capped python -m pytest tests/test_attention.py tests/test_causality.py tests/test_model.py tests/test_training.py -q \
        -p no:cacheprovider > "$OUT_DIR/tests.txt" 2>&1
    tail -3 "$OUT_DIR/tests.txt" | tee -a "$LOG"
fi

train_run() {  # CONFIG NAME TARGET [--field=value ...]: one training run through bench.py, figures to NAME.json
    local config=$1 name=$2 target=$3
    shift 3
    step "training run: $config $* on $DEVICE"
    if [ ! -f "$DATA" ]; then
        echo "no corpus at $DATA: set SHAKESPEARE=path/to/input.txt" | tee -a "$LOG"
        status=1
        return
    fi
    capped python benchmarks/bench.py "$config" --dataset="$DATA" --device="$DEVICE" --out_dir="$OUT_DIR/run" \
        --overwrite=true --target_val="$target" --json="$OUT_DIR/$name.json" "${TRAIN_ARGS[@]}" "$@" >> "$LOG" 2>&1
    grep -E '"(ms_per_step_median|tokens_per_second|train_seconds|mfu|final_val_loss)"' "$OUT_DIR/$name.json" \
        2>/dev/null | tee -a "$LOG"
}
if want fast; then
    train_run configs/shakespeare_char_fast.toml train_fast 1.47
    step "the fast run's checkpoint: the causality checks (float64, CPU), then a sample on $DEVICE"
    capped python tests/causality.py --ckpt "$OUT_DIR/run/ckpt.pt" > "$OUT_DIR/causality_ckpt.txt" 2>&1
    tail -3 "$OUT_DIR/causality_ckpt.txt" | tee -a "$LOG"
    capped python sample.py --out_dir="$OUT_DIR/run" --device="$DEVICE" --max_new_tokens=400 > "$OUT_DIR/sample.txt" 2>&1
    head -c 600 "$OUT_DIR/sample.txt" | tee -a "$LOG"
fi
if want eager; then  # does compiling pay for a cold machine's first run? (cold, it cost 47 s of an 88 s run)
    train_run configs/shakespeare_char_fast.toml train_fast_eager 1.47 --compile=false
fi
if want nanogpt; then  # nanoGPT's GPU command, our baby GPT and our fast recipe, each compiled warm
    step "side by side with nanoGPT ($NANOGPT) on $DEVICE"
    capped python benchmarks/vs_nanogpt.py --gpu --nanogpt="$NANOGPT" --dataset="$DATA" --rounds=1 \
        --ours configs/shakespeare_char.toml configs/shakespeare_char_fast.toml --json="$OUT_DIR/vs_nanogpt_gpu.json" \
        > "$OUT_DIR/vs_nanogpt_gpu.txt" 2>&1
    tail -30 "$OUT_DIR/vs_nanogpt_gpu.txt" | tee -a "$LOG"
fi
if want baby; then
    train_run configs/shakespeare_char.toml train_manual 1.48  # the from-scratch attention: what every config trains
    # sdpa for its step time alone: 1000 steps give the median ms/step (its val is not comparable: fewer steps)
    train_run configs/shakespeare_char.toml train_sdpa 9 --attn_backend=sdpa $([ "${DRY:-0}" = "1" ] || echo --max_iters=1000)
    step "manual vs sdpa"
    capped python - "$OUT_DIR" <<'EOF' > "$OUT_DIR/manual_vs_sdpa.json"
import json, sys
runs = {b: json.load(open(f"{sys.argv[1]}/train_{b}.json")) for b in ("manual", "sdpa")}
out = {b: {k: r.get(k) for k in ("ms_per_step_median", "tokens_per_second", "mfu", "final_val_loss")}
       for b, r in runs.items()}
out["manual_over_sdpa_step_time"] = runs["manual"]["ms_per_step_median"] / runs["sdpa"]["ms_per_step_median"]
print(json.dumps(out, indent=2))
EOF
    cat "$OUT_DIR/manual_vs_sdpa.json" | tee -a "$LOG"
fi
if want kv; then
    step "KV-cache benchmark on $DEVICE"
    capped python benchmarks/kv_cache.py --device="$DEVICE" --json="$OUT_DIR/kv_cache.json" "${KV_ARGS[@]}" >> "$LOG" 2>&1
    grep -E "per_second|speedup|identical" "$OUT_DIR/kv_cache.json" 2>/dev/null | tee -a "$LOG"
    step "rolling KV cache (attn_window=64, rotary) to 16 x block_size on $DEVICE"
    capped python benchmarks/kv_cache.py --device="$DEVICE" --window=64 --json="$OUT_DIR/kv_cache_rolling.json" \
        $([ "${DRY:-0}" = "1" ] && echo --small) >> "$LOG" 2>&1
    grep -E "blocks|per_second|cache_bytes|identical" "$OUT_DIR/kv_cache_rolling.json" 2>/dev/null | tee -a "$LOG"
fi
if want window; then
    train_run configs/shakespeare_char_fast.toml train_fast_window64 1.50 --attn_window=64  # a window of 64 of 256
fi
after=$([ "${DRY:-0}" = "1" ] && echo 10 || echo 90)  # part signals: the cold compile and some steps
if want signals && [ $((DEADLINE - SECONDS)) -le $((after + 10)) ]; then
    echo "skipped (BUDGET_S spent): part signals" | tee -a "$LOG"
    status=1
elif want signals; then  # Triton's LLVM once took SIGTERM over (RESULTS.md): a compiled CUDA run must still save
    step "timeout's SIGTERM (to the process, then its group) to a compiled run on $DEVICE: it must save"
    timeout -s TERM "$after" python train.py configs/shakespeare_char_fast.toml --dataset="$DATA" --device="$DEVICE" \
        --out_dir="$OUT_DIR/sig" --overwrite=true "${TRAIN_ARGS[@]}" --max_iters=100000 --lr_decay_iters=100000 \
        > "$OUT_DIR/signals.txt" 2>&1 &
    tpid=$!
    sleep $((after - 5))
    pid=$(pgrep -P "$tpid")  # its signal masks (SigCgt 4000: TERM caught) and its children, just before the signals
    { grep -E "SigCgt|SigIgn" "/proc/$pid/status"; ps -o pid,pgid,cmd --ppid "$pid"; } > "$OUT_DIR/signals_proc.txt"
    wait "$tpid"
    echo "timeout's status $? (124: it signalled); left: $(ls "$OUT_DIR/sig" | tr '\n' ' ')" >> "$OUT_DIR/signals_proc.txt"
    tail -3 "$OUT_DIR/signals.txt" | cat - "$OUT_DIR/signals_proc.txt" | tee -a "$LOG"
    [ -f "$OUT_DIR/sig/ckpt.pt" ] || { echo "FAIL: the signalled run saved no checkpoint" | tee -a "$LOG"; status=1; }
fi

rm -rf "${OUT_DIR:?}/run" "${OUT_DIR:?}/sig"  # checkpoints and caches stay behind: only figures come back
step "done (status $status); results in $OUT_DIR"
exit $status
