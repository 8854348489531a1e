#!/usr/bin/env bash
# One sitting of a sweep (python -m hax_jax.sweep) on a lent GPU machine, resumable on the next one:
#
#     bash bench/sweep_sitting.sh SECONDS OUTDIR CONFIG [sweep options and overrides ...]
#
# The runs live in runs/sweep (ignored by git). A sitting unpacks runs/sweep.tgz.part-* (the
# last sitting's runs, carried in) there, runs the sweep with --out runs/sweep for at most SECONDS
# (then SIGTERM: every train.py saves and stops; the same command resumes), and packs the runs
# into OUTDIR/sweep.tgz.part-* of 15 MiB each: a device call returns files of at most 16 MiB.
# Back here: `mkdir -p runs && cp OUTDIR/sweep.tgz.part-* runs/`, carry `runs` in the next call,
# and `cat runs/sweep.tgz.part-* | tar xzf - -C runs` to read them (eval.py, RESULTS.md).
set -uo pipefail
seconds=${1:?seconds}
out=${2:?output directory}
shift 2
if [[ ! $seconds =~ ^[1-9][0-9]*$ ]]; then
    echo "error: SECONDS must be a positive whole number of seconds, got '$seconds'" >&2
    exit 2
fi
mkdir -p runs "$out"
if compgen -G "runs/sweep.tgz.part-*" >/dev/null; then
    cat runs/sweep.tgz.part-* | tar xzf - -C runs || exit 1
fi
timeout -k 60 -s TERM "$seconds" python -m hax_jax.sweep "$@" --out runs/sweep --no-plots
echo "sweep rc=$? $(date +%T)"
tar czf - -C runs sweep | split -b 15M - "$out/sweep.tgz.part-"
ls -l "$out"
