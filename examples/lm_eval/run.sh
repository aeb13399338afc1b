#!/usr/bin/env bash
# Run the two local lm-eval tasks (demo_choice: loglikelihood; demo_continue:
# generate-until) against a running front with lm-eval's `local-completions`, once with
# token-id prompts (lm-eval's default, tokenized_requests=True) and once with text.
#   examples/lm_eval/run.sh [FRONT_URL] [MODEL] [ENGINE_DIR]
# defaults: http://127.0.0.1:8080, demo, engines/demo (its tokenizer.json and
# tokenizer_config.json, loaded by transformers' AutoTokenizer). lm-eval: pip install "lm-eval[api]".
# Extra lm_eval arguments: LM_EVAL_ARGS="--limit 5" examples/lm_eval/run.sh ...
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
front="${1:-http://127.0.0.1:8080}"
model="${2:-demo}"
engine="$(cd "${3:-$here/../../engines/demo}" && pwd)"
cd "$here"                       # the task YAMLs' data_files are relative to this directory
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1   # local data and tokenizer only
for tokenized in True False; do
  echo "==> tokenized_requests=$tokenized"
  lm_eval --model local-completions \
    --model_args "model=$model,base_url=$front/v1/completions,tokenizer=$engine,tokenized_requests=$tokenized,num_concurrent=2,max_retries=1" \
    --tasks demo_choice,demo_continue --include_path "$here" ${LM_EVAL_ARGS:-}
done
