# On a lent CUDA machine, one call (run's timeout_s 600): make gpu-check, then make gpu-bench with one
# profiled long row, each in its own time limit so that both fit one 10-minute command. From the
# repository root with .gpu/ carried; logs and rows into $OUT.
# gpu-check took 214 s on an H200 before the fused kernel's tests joined it (their first call of each
# kernel variant compiles it): 290 s for it, 270 s for the bench.
LIMIT=${CHECK_LIMIT:-290} bash .gpu/run.sh
LIMIT=${BENCH_LIMIT:-270} BENCH_ARGS="--budget-s ${BENCH_BUDGET:-240} --profile ${PROFILE:-ad-drop-ga-all-fused@4096} ${BENCH_ARGS:-}" \
  bash .gpu/bench.sh
cp docs/results/gpu_bench/*.txt "${OUT:-/tmp}/" 2>/dev/null
true
