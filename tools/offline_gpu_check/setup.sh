# On the CUDA machine, sourced by run.sh: the image's python3 (with torch) as /tmp/v/bin/python, the
# bundle on PYTHONPATH, fairseq's Cython helpers built, and the console scripts the tests call from
# beside sys.executable.
set -e
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
SITE=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
mkdir -p /tmp/v/bin && ln -sf "$(command -v python3)" /tmp/v/bin/python
export PYTHONPATH=/tmp/site:$R/.gpu/site:$R:$R/lab:$SITE
(cd .gpu/site && /tmp/v/bin/python ../build_ext.py >/dev/null 2>&1) || (cd .gpu/site && /tmp/v/bin/python ../build_ext.py 2>&1 | tail -5)
mk() { printf '#!/tmp/v/bin/python\nimport sys\nfrom %s import %s as f\nsys.exit(f())\n' "$2" "$3" > /tmp/v/bin/$1; chmod +x /tmp/v/bin/$1; }
for c in train:train generate:generate preprocess:preprocess interactive:interactive validate:validate score:score eval-lm:eval_lm; do mk fairseq-${c%%:*} fairseq_cli.${c##*:} cli_main; done
mk attn-reg-prepare attn_reg_plugin.prepare main
mk attn-reg-mt-sweep attn_reg_plugin.sweep main
mk attn-reg-mt-compare attn_reg_plugin.sweep.compare main
mk attn-reg-average-checkpoints attn_reg_plugin.average_checkpoints main
mk attn-reg-user-dir attn_reg_plugin.user_dir main
nvidia-smi -L
/tmp/v/bin/python -c "import torch, transformers, fairseq, fairseq.data.data_utils_fast as d; print('torch', torch.__version__, 'tf', transformers.__version__, 'fairseq', fairseq.__version__, torch.cuda.get_device_name())"
