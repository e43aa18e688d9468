#!/usr/bin/env bash
# Pack what `make gpu-check` needs beyond a CUDA machine's own torch into .gpu/ (git-ignored), for a
# machine that reaches no package registry: fairseq's pure-Python tree from this venv (its compiled
# helpers are for this Python, so they are left out and the two Cython ones rebuilt there from the
# sdist's .pyx), hydra/omegaconf/antlr4, bitarray as a wheel for the target's Python, and what
# gpu-bench needs (bench.sh).
# Usage, from the repository root: tools/offline_gpu_check/bundle.sh [target python version, 3.12]
set -euo pipefail
PYV=${1:-3.12}
SITE=$(.venv/bin/python -c 'import fairseq, os; print(os.path.dirname(os.path.dirname(fairseq.__file__)))')
rm -rf .gpu && mkdir -p .gpu/site .gpu/whl
for d in fairseq fairseq_cli hydra omegaconf antlr4; do cp -r "$SITE/$d" .gpu/site/; done
find .gpu/site -name __pycache__ -prune -exec rm -rf {} + && find .gpu/site -name '*.so' -delete
url=$(curl -fsS https://pypi.org/simple/fairseq-fixed/ | grep -o 'https://[^"#]*fairseq_fixed-0.12.3.1.tar.gz' | head -1)
curl -fsS "$url" | tar xz -C .gpu --strip-components=1 --wildcards 'fairseq_fixed-0.12.3.1/fairseq/data/*_fast.pyx'
mv .gpu/fairseq/data/*.pyx .gpu/site/fairseq/data/ && rm -rf .gpu/fairseq
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl "bitarray==$(.venv/bin/python -c 'import bitarray; print(bitarray.__version__)')"
cp tools/offline_gpu_check/{setup.sh,run.sh,bench.sh,lent.sh,build_ext.py} .gpu/
# gpu-bench: the MiniLM's config and tokenizer (bench.sh gives it random weights there) and the commit.
mkdir -p .gpu/minilm && M=$(.venv/bin/python -c 'from attn_reg_lab.paths import minilm_dir; print(minilm_dir())')
cp "$M"/{config.json,tokenizer.json,tokenizer_config.json,vocab.txt,special_tokens_map.json} .gpu/minilm/
echo "$(git rev-parse --short HEAD)$(git status --porcelain --untracked-files=no | grep -q . && echo -dirty)" > .gpu/commit
du -sh .gpu
