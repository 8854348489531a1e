#!/usr/bin/env bash
# Issue 20: where the HAX branch's step time goes, by source line, on one GPU:
#
#     bash bench/hax_cost.sh short|long OUTDIR
#
# short: Mamba-2 130M and HAX-Mamba-2 130M at 8 x 2048 (about 4 minutes); long: the same at 1 x 65536
# (remat on, about 7 minutes). Each step is timed (20 steps; 10 at 64K), profiled (every kernel, 3
# steps) and its optimized HLO written, then `bench/kernel_attribution.py` prints, per source line,
# the HAX step's kernel time minus Mamba-2's (`--scale 1`): the branch's cost and what else moved.
set -uo pipefail
mode=${1:?mode: short or long}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/hax_jax_cache}
# One GPU unless the caller chose: on a machine of several the bench would split the batch over "data".
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
case $mode in
short) mamba2=lm_mamba2_130m hax=lm_hax_mamba2_130m steps=20 extra="" ;;
long) mamba2=lm_mamba2_130m_32k hax=lm_hax_mamba2_130m_64k steps=10 extra="--set data.seq_len=65536" ;;
*) echo "error: mode must be short or long, got '$mode'" >&2; exit 2 ;;
esac
for case in $mamba2 $hax; do
    set_args=""
    [[ $case == "$mamba2" ]] && set_args=$extra  # the Mamba-2 case at the HAX case's length
    echo "== $case $(date +%T)"
    timeout -s INT 400 python bench/train_throughput.py --no-e2e --cases "$case" --steps $steps \
        --profile 400 --hlo-dir "$out/hlo" $set_args >"$out/$case.log" 2>&1
    echo "rc=$? $(date +%T)" >>"$out/$case.log"
    grep -h "^| lm" "$out/$case.log" | tail -1
done
python bench/kernel_attribution.py "$out/hlo/$mamba2.hlo.txt" "$out/$mamba2.log" \
    "$out/hlo/$hax.hlo.txt" "$out/$hax.log" --scale 1 | tee "$out/attribution_$mode.txt"
