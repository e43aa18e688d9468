# On the CUDA machine, from the repository root with .gpu/ carried: `make gpu-check`'s files (read
# from the Makefile, so the list has one home) with its marker, 8 workers; logs into $OUT if set.
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
FILES=${FILES:-$(sed -n '/^gpu-check:/,/^$/p' Makefile | grep -o 'tests/[^ ]*\.py' | tr '\n' ' ')}
timeout "${LIMIT:-400}" /tmp/v/bin/python -m pytest -q -rfEsxX -m gpu -p no:cacheprovider --timeout=240 -n 8 $FILES \
  2>&1 | tee "${OUT:-/tmp}/gpu_check.log" | tail -80
