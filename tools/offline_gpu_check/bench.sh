# On the CUDA machine, from the repository root with .gpu/ carried: `make gpu-bench` through the
# bundle. The MiniLM's weights (88 MB) do not fit the carried tree, so its standard rows use the
# same architecture and tokenizer with random weights (the cost of a step does not depend on them;
# the rows' meta file says so). Rows into $OUT and docs/results/gpu_bench/.
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
/tmp/v/bin/python - <<'PY'
import shutil, transformers
config = transformers.AutoConfig.from_pretrained(".gpu/minilm")
transformers.AutoModel.from_config(config).save_pretrained("/tmp/minilm-random")
for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
    shutil.copy(f".gpu/minilm/{f}", "/tmp/minilm-random/")
PY
timeout "${LIMIT:-360}" /tmp/v/bin/python -m attn_reg_lab.gpu_bench --commit "$(cat .gpu/commit)" \
  --hf-model /tmp/minilm-random ${BENCH_ARGS:-} 2>&1 | tee "${OUT:-/tmp}/gpu_bench.log" | grep -v '^  '
cp docs/results/gpu_bench/*.json "${OUT:-/tmp}/" 2>/dev/null
