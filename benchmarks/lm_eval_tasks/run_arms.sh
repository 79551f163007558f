#!/usr/bin/env bash
# The accuracy cost of head-wise configurations as lm-evaluation-harness measures it: the same three
# tasks against the server with the flag off, the shipped head-wise configuration, and all heads
# sliding. Usage (repository root): bash benchmarks/lm_eval_tasks/run_arms.sh [MODEL] [OUT_DIR]
# Needs: pip install "lm-eval[api]==0.4.13"; writes OUT_DIR/<arm>/ (lm_eval's JSON) and server logs.
set -euo pipefail
MODEL=${1:-smollm2-135m-instruct}
OUT=${2:-lm_eval_results}
PORT=${PORT:-8731}
TASKS=${TASKS:-pydoc_next_sentence,pydoc_perplexity,pydoc_recall,pydoc_needles}
ALL_SLIDING='{"sliding_window": 512, "sink_size": 64, "swa_kv_heads": [0, 1, 2]}'
python benchmarks/lm_eval_tasks/make_data.py --needles-model "$MODEL"
mkdir -p "$OUT"

run_arm() {  # run_arm NAME FD_HEAD_WISE_KV_CACHE [server flags...]
  local name=$1 flag=$2; shift 2
  FD_HEAD_WISE_KV_CACHE=$flag python -m fastdeploy.entrypoints.openai.api_server --model "$MODEL" \
      --port "$PORT" --disable-uvicorn-access-log "$@" > "$OUT/$name.server.log" 2>&1 &
  local server=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 "$server" || { echo "server of arm $name died; see $OUT/$name.server.log"; exit 1; }
    sleep 2
  done
  lm_eval --model local-completions \
      --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=remote,max_length=2048,num_concurrent=1" \
      --include_path benchmarks/lm_eval_tasks --tasks "$TASKS" --output_path "$OUT/$name" --seed 0 \
      2>&1 | tee "$OUT/$name.lm_eval.log" | grep -E "^\|" || true
  kill "$server"; wait "$server" || true
}

run_arm flag_off 0
run_arm head_wise_shipped 1
run_arm all_heads_sliding 1 --head-wise-swa-config "$ALL_SLIDING"
