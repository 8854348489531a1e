#!/usr/bin/env bash
# One sitting of a sweep (python -m hax_jax.sweep) on a lent GPU machine, resumable on the next one:
#
#     [MPS=1] bash bench/sweep_sitting.sh SECONDS OUTDIR CONFIG [sweep options and overrides ...]
#
# The runs live in runs/sweep (ignored by git). A sitting unpacks runs/sweep.tgz.part-* (the
# last sitting's runs, carried in) there, runs the sweep with --out runs/sweep for at most SECONDS
# (then SIGTERM: every train.py saves and stops; the same command resumes), and packs the runs
# into OUTDIR/sweep.tgz.part-* of 15 MiB each (each run's newest finished checkpoint alone): a device
# call returns files of at most 16 MiB, and carries in at most 64 MiB. Leave 90 s of the call's limit
# after SECONDS for the runs to save and the packing: 18 runs on 4 x H200 with SECONDS 545 ran past a
# 600 s call (the files came back, the printed table did not).
# Back here: `mkdir -p runs && cp OUTDIR/sweep.tgz.part-* runs/`, carry `runs` in the next call,
# and `cat runs/sweep.tgz.part-* | tar xzf - -C runs` to read them (eval.py, RESULTS.md). MPS=1 runs
# the sitting under CUDA's multi-process service (not yet measured against the default).
# Evaluation splits drawn beforehand (here: `HAX_JAX_CACHE=runs/split_cache python -m hax_jax.sweep
# CONFIG [the same --cells and overrides] --draw-splits`, then `tar czf runs/split_cache.tgz -C runs
# split_cache`) are unpacked and read, so no run draws them on the GPU machine (the grid's two
# splits took this project's 2-core CPU about 3 minutes each; GPUs sat idle 2-3 minutes a sitting).
set -uo pipefail
seconds=${1:?seconds}
out=${2:?output directory}
shift 2
if [[ ! $seconds =~ ^[1-9][0-9]*$ ]]; then
    echo "error: SECONDS must be a positive whole number of seconds, got '$seconds'" >&2
    exit 2
fi
mkdir -p runs "$out"
if [[ ${MPS:-0} == 1 ]]; then
    # CUDA's multi-process service: the runs' small kernels may share the GPU at once instead of
    # taking turns (18 runs together reached 4.5 M tokens/s, within what one runs alone: 4.2 to 7.2
    # M in BENCHMARKS.md's jr rows).
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/hax_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/hax_mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    # The daemon sees every GPU: given CUDA_VISIBLE_DEVICES=1,2,3 it numbers them 0,1,2 for its
    # clients, so the runs the sweep pinned to GPU 3 found no GPU and JAX trained them on the CPU
    # (5 of 16, twenty-seventh session), and none went to GPU 1.
    if ! env -u CUDA_VISIBLE_DEVICES nvidia-cuda-mps-control -d; then
        echo "error: MPS=1 but nvidia-cuda-mps-control -d failed" >&2
        exit 1
    fi
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
if [[ -f runs/split_cache.tgz ]]; then
    tar xzf runs/split_cache.tgz -C runs || exit 1
    export HAX_JAX_CACHE=$PWD/runs/split_cache
fi
if compgen -G "runs/sweep.tgz.part-*" >/dev/null; then
    cat runs/sweep.tgz.part-* | tar xzf - -C runs || exit 1
fi
timeout -k 60 -s TERM "$seconds" python -m hax_jax.sweep "$@" --out runs/sweep --no-plots
echo "sweep rc=$? $(date +%T)"
# Only each run's newest finished checkpoint travels: a resume reads no other, and 18 runs' three
# checkpoints each packed to 67 MB, over the 64 MiB a call may carry in.
for dir in runs/sweep/*/checkpoints; do
    newest=""
    for step in $(ls -1 "$dir" | grep -E '^[0-9]+$' | sort -n); do
        [[ -e $dir/$step/commit_success.txt ]] && newest=$step
    done
    for step in $(ls -1 "$dir" | grep -E '^[0-9]+$'); do
        if [[ -n $newest ]] && ((step < newest)); then rm -rf "${dir:?}/$step"; fi
    done
done
tar czf - -C runs sweep | split -b 15M - "$out/sweep.tgz.part-"
ls -l "$out"
