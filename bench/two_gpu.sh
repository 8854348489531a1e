#!/usr/bin/env bash
# The 2-GPU measurements of BENCHMARKS.md "Multi-GPU training step", one phase per call (each meant
# to end within 10 minutes on 2 x H100):
#
#     bash bench/two_gpu.sh PHASE OUTDIR
#
# PHASE: dp_tp     Mamba-2 130M, 8 x 2048 a GPU: one GPU (profile, optimized HLO), data=2 (HLO),
#                  tensor=2, data=2 with FSDP, data=2 with 16 MiB all-reduces and XLA's
#                  latency-hiding scheduler, data=2 with mesh.shard_optimizer (PROFILE=N: list N
#                  kernels, default 60);  dp: the same without tensor=2 and FSDP, then one GPU
#                  again;  dp_flags: one GPU, data=2 under XLA flags for the gradient all-reduces
#                  and the latency-hiding scheduler;  dp_combine: one GPU, data=2 with the
#                  all-reduces joined up to one block and never (mesh.combine_collectives=block,
#                  off) and up to 64 MiB, 128 MiB and 1 GiB (one all-reduce)
#        seq       Mamba-2 130M 1 x 32768 (one GPU, seq=2, seq=2 with mesh.shard_optimizer), and
#                  HAX-Mamba-2 130M 1 x 65536 on one GPU
#        seq_profile  the seq phase's Mamba-2 steps alone: one GPU and seq=2, profiled, with HLOs
#        seq_memory  Mamba-2 130M 1 x 32768, one GPU, then seq=2 plain, with mesh.shard_optimizer
#                  and with mesh.fsdp (collectives joined up to a block, the default), each profiled
#                  and again under XLA's latency-hiding scheduler: issue 17's memory per GPU
#        gather_seq  Mamba-2 130M 1 x 32768: one GPU, then seq=2 plain, with mesh.shard_optimizer
#                  (the updated parameters gathered at the step's end) and with it and
#                  mesh.param_gather=use (gathered at the next step's start), the last two profiled;
#                  gather_dp: the same settings at 8 x 2048 a GPU, one GPU and data=2
#        seq_p2p   Mamba-2 130M 1 x 32768: one GPU, then seq=2 with NCCL's collective-permutes and
#                  with XLA's local peer-to-peer copies instead (--xla_gpu_use_memcpy_local_p2p;
#                  one process drives both GPUs), plain and with mesh.shard_optimizer
#        seq_latency  Mamba-2 130M 1 x 32768: one GPU, then seq=2 plain, with NCCL's low-latency
#                  protocol for peer-to-peer messages up to 1 MiB (the SSD states, 768 KiB; the
#                  conv halos, 10.5 KiB, take it already), under XLA's latency-hiding scheduler,
#                  and under PGLE
#        seq_ab    Mamba-2 130M 1 x 32768, one GPU and seq=2, for this tree and for the commits
#                  BASE="REV [REV...]" (git worktrees in /tmp/hax_base_REV): one GPU for this tree
#                  and the first REV side by side, then seq=2 for each
#        dp_ab     Mamba-2 130M 8 x 2048 a GPU, one GPU for this tree, then data=2 for this tree and
#                  for each commit of BASE="REV [REV...]" (as seq_ab), then the data=2 rows again in
#                  the same order from the compilation cache (the spread between the rounds)
#        seq_hax_ab  HAX-Mamba-2 130M 1 x 65536 (24 blocks) on seq=2 for this tree and for BASE="REV
#                  [REV...]" (as seq_ab), 20 steps timed, then profiled: the timed step beside
#                  the profile's span; every tree ROUNDS times (default 2), in turn (about 4 minutes a
#                  tree, then 40 s a row), with each tree's optimized HLO from the first round (the
#                  HLOs and kernel lists feed bench/kernel_attribution.py)
#        seq_hax   HAX-Mamba-2 130M 1 x 65536, one GPU and seq=2, profiled (LAYERS=N: N of the 24
#                  blocks, e.g. 4: each block's cost in about 2 minutes instead of 9)
#                  (the seq and seq_hax phases write optimized HLOs to OUTDIR/hlo_*: compare two
#                  steps per source line with `python bench/kernel_attribution.py ONE.hlo.txt
#                  one.log SEQ2.hlo.txt seq2.log --scale 0.5`)
#        hax_64k   issue 17's HAX target alone: HAX-Mamba-2 130M 1 x 65536 (24 blocks), one GPU, then
#                  seq=2 timed after the default 2 untimed steps, then seq=2 again without them
#                  (from the compilation cache): about 8 minutes;  hax_64k_apart: seq=2 with XLA's
#                  collective-permutes never joined, then one GPU and seq=2 as compiled again (from
#                  the compilation cache when hax_64k ran on the same machine just before)
#        hax_memory  HAX-Mamba-2 130M 1 x 65536 (24 blocks) on seq=2, 3 steps timed, XLA's memory
#                  account and optimized HLO (for bench/hlo_liveness.py): the collectives joined up
#                  to a block (the default) and never (mesh.combine_collectives=off); about 8 minutes
#        hax_sched HAX-Mamba-2 130M 1 x 65536 on seq=2 (LAYERS=N blocks, default 4), profiled: as
#                  compiled, with XLA's collective-permutes never joined, and under XLA's
#                  latency-hiding scheduler
#        pgle_seq  Mamba-2 130M 1 x 32768, one GPU and seq=2, each with XLA's profile-guided latency
#                  estimates (JAX_ENABLE_PGLE: 3 profiled runs, then a recompile) and without
#        pgle_dp   the same for 8 x 2048 a GPU, one GPU and data=2
#        nccl_dp   one GPU and data=2 at 8 x 2048 a GPU, data=2 also under NCCL_PROTO=Simple and
#                  =LL128 (the profiles show the all-reduces in NCCL's LL protocol)
#        jr        the joint-recall cells jr_mamba2_none, jr_mamba2_hax, jr_mamba_hax on GPU 0 (issue
#                  21): the step and train.py end to end, with custom calls kept out of XLA's CUDA
#                  graphs (train.py's default) and then recorded into them
#        big_one   Mamba-2 1.3B and 2.7B (model.remat=block), one GPU each
#        tp_2_7b   Mamba-2 2.7B on tensor=2;  tp_1_3b: 1.3B on tensor=2
#                  (BATCH=N: N rows of 2048 for big_one and tp_*; default 8; LHS=1: tp_* with
#                  XLA's latency-hiding scheduler, logged as tensor2_<size>_lhs)
#        threshold  one GPU and data=2 (Mamba-2 130M, 8 x 2048 a GPU), then one GPU and seq=2 (1 x
#                  32768), each 2-GPU step as compiled and with XLA's all-reduces joined only up to MIBS
#                  MiB (default "4"; the in_proj and out_proj gradients, 10.3 and 4.7 MB, stay whole
#                  and are not copied, the small ones are joined; mesh.combine_collectives=on)
#        graphs    one GPU and data=2 (Mamba-2 130M, 8 x 2048 a GPU), each as run and with XLA's
#                  collectives recorded into its CUDA graphs too (GRAPHS, default
#                  "-CUSTOM_CALL,+COLLECTIVES": the step's idle gaps between graphs, eighteenth session)
#        procs     train.py end to end: one GPU, one process over 2 GPUs, two processes (README launch),
#                  for CASE (default lm_mamba2_130m) on the 2-GPU mesh TWO (default "mesh.data=2
#                  data.batch_size=16"; e.g. CASE=lm_mamba2_130m_32k TWO="mesh.data=1 mesh.seq=2")
#                  (RUNS: which of "one 1proc 2proc", default all; STEPS: steps a window, default 20;
#                  LIMIT: seconds a run, default 170, two processes 30 more)
#
# The GPU machine's copy of this repository holds main's history only: send branches to compare as a
# git bundle beside the tree (`git bundle create FILE BRANCH... --not main`) and name it in
# BUNDLE=FILE, whose branches are fetched before the BASE commits are checked.
#
# One-GPU cases of a phase run side by side, one per GPU (CUDA_VISIBLE_DEVICES), then its 2-GPU cases
# one at a time. Every case's log goes to OUTDIR/<case>.log; a case past its time limit is stopped and
# the phase goes on. Compiled programs are kept in $JAX_COMPILATION_CACHE_DIR (default
# /tmp/hax_jax_cache) for the phases after.
set -uo pipefail
phases="dp, dp_tp, dp_flags, dp_combine, seq, seq_profile, seq_memory, gather_seq, gather_dp, seq_p2p, seq_latency"
phases+=", seq_ab, dp_ab, seq_hax_ab"
phases+=", seq_hax, hax_64k, hax_64k_apart, hax_memory, hax_sched, pgle_seq"
phases+=", pgle_dp, nccl_dp, jr, big_one, tp_2_7b, tp_1_3b, threshold, graphs, procs"
phase=${1:?phase: one of $phases}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/hax_jax_cache}
steps="--steps 20 --no-e2e"
big="model.remat=block data.batch_size=${BATCH:-8}"

run() {  # run NAME SECONDS COMMAND...: one case, logged, stopped at its limit
    local name=$1 limit=$2
    shift 2
    echo "== $name $(date +%T)"
    timeout -s INT "$limit" "$@" >"$out/$name.log" 2>&1
    echo "rc=$? $(date +%T)" >>"$out/$name.log"
    pkill -9 -f '/[t]rain[.]py ' 2>/dev/null  # no train.py of a stopped case is left on a GPU
    grep -h -A8 "^collectives of" "$out/$name.log"
    grep -h "^| lm\|^| jr" "$out/$name.log" | tail -1
    grep -h "^error\|RESOURCE_EXHAUSTED" "$out/$name.log" | tail -2
}
tp="python bench/train_throughput.py"  # a command (timeout runs programs, not functions)
gpu() { local device=$1; shift; CUDA_VISIBLE_DEVICES=$device "$@"; }

lhs_flags="--xla_gpu_enable_latency_hiding_scheduler=true"
# XLA joins no collective-permutes (by default up to 30 MiB are joined into one)
permutes_apart="--xla_gpu_collective_permute_combine_threshold_bytes=1"
seq2="mesh.data=1 mesh.seq=2"
hax_64k="--cases lm_hax_mamba2_130m_64k --steps 10 --no-e2e"  # issue 17's HAX step, 10 steps timed
profiled_one_gpu_32k() {  # Mamba-2 130M 1 x 32768 on GPU 0, profiled, with its HLO
    gpu 0 run one_gpu_32k 200 $tp --cases lm_mamba2_130m_32k $steps --collectives --profile 400 \
        --hlo-dir "$out/hlo_one"
}
profiled_seq2_32k() {  # the same on seq=2
    run seq2_32k 150 $tp --cases lm_mamba2_130m_32k $steps --collectives --profile 400 \
        --hlo-dir "$out/hlo_seq2" --set $seq2
}
data_parallel() {  # one GPU and data=2 at 8 x 2048 a GPU (the dp and dp_tp phases)
    mkdir -p "$out/hlo_one" "$out/hlo_data2"
    gpu 0 run one_gpu_130m 130 $tp --cases lm_mamba2_130m $steps --profile "${PROFILE:-60}" --hlo-dir "$out/hlo_one"
    run data2_130m 130 $tp --cases lm_mamba2_130m $steps --collectives --profile "${PROFILE:-60}" \
        --hlo-dir "$out/hlo_data2" --set mesh.data=2 data.batch_size=16
    # Smaller combined all-reduces that the latency-hiding scheduler may start during the backward.
    XLA_FLAGS="$lhs_flags --xla_gpu_all_reduce_combine_threshold_bytes=16777216" \
        run data2_lhs_130m 130 $tp --cases lm_mamba2_130m $steps --collectives \
        --set mesh.data=2 data.batch_size=16
    # The AdamW moments and the update split over "data" (ZeRO-1).
    run data2_shard_optimizer_130m 130 $tp --cases lm_mamba2_130m $steps --collectives \
        --set mesh.data=2 mesh.shard_optimizer=true data.batch_size=16
}

if [[ $phase == seq_ab || $phase == dp_ab || $phase == seq_hax_ab ]]; then
    bases=(${BASE:?BASE=REV [REV...]: the commits to compare with})
    if [[ -n ${BUNDLE:-} ]]; then
        git fetch -q "$BUNDLE" 'refs/heads/*:refs/heads/*' || exit 2
    fi
    for rev in "${bases[@]}"; do  # a machine's copy of the repository may predate the session's commits
        if ! git rev-parse --verify -q "$rev^{commit}" >/dev/null; then
            echo "error: BASE commit '$rev' is not in this copy's git history (BUNDLE=FILE sends branches)" >&2
            exit 2
        fi
    done
fi
base_tp() {  # base_tp REV: train_throughput.py of a worktree of REV, made once
    local tree=/tmp/hax_base_$1
    [[ -d $tree ]] || git worktree add -f --detach "$tree" "$1" >/dev/null
    echo "env PYTHONPATH=$tree:${PYTHONPATH:-} python $tree/bench/train_throughput.py"
}

case $phase in
dp)
    data_parallel
    # The one-GPU step again, from the compilation cache: the spread between the two is the noise.
    gpu 0 run one_gpu_130m_again 100 $tp --cases lm_mamba2_130m $steps
    ;;
dp_tp)
    data_parallel
    run tensor2_130m 130 $tp --cases lm_mamba2_130m $steps --collectives --profile 60 \
        --set mesh.data=1 mesh.tensor=2
    run fsdp2_130m 130 $tp --cases lm_mamba2_130m $steps --collectives \
        --set mesh.data=2 mesh.fsdp=true data.batch_size=16
    ;;
dp_combine)
    # Each joined all-reduce is copied into one buffer and sliced out after (about 1.8 ms of
    # concatenations, copies and slices a step at data=2, eighteenth session) and the GPU idles
    # in short gaps around them: fewer, larger joins copy as much but wait less often; smaller
    # ones may start during the backward; unjoined ones copy nothing but launch ~400 times.
    gpu 0 run one_gpu_130m 130 $tp --cases lm_mamba2_130m $steps
    two="mesh.data=2 data.batch_size=16"
    run data2_130m 130 $tp --cases lm_mamba2_130m $steps --collectives --set $two
    for how in block off; do  # off: each gradient reduced in its own buffer, nothing copied
        run "data2_${how}_130m" 130 $tp --cases lm_mamba2_130m $steps --collectives \
            --set $two "mesh.combine_collectives=$how"
    done
    for mib in 64 128 1024; do
        XLA_FLAGS="--xla_gpu_all_reduce_combine_threshold_bytes=$((mib << 20))" \
            run "data2_${mib}mib_130m" 130 $tp --cases lm_mamba2_130m $steps --collectives --set $two
    done
    gpu 0 run one_gpu_130m_again 100 $tp --cases lm_mamba2_130m $steps
    ;;
seq)
    profiled_one_gpu_32k &
    gpu 1 run one_gpu_hax_64k 400 $tp --cases lm_hax_mamba2_130m_64k --steps 10 --no-e2e --collectives &
    wait
    profiled_seq2_32k
    # The AdamW moments split over "seq" too: each shard held a whole replica.
    run seq2_32k_shard_optimizer 150 $tp --cases lm_mamba2_130m_32k $steps --collectives \
        --set $seq2 mesh.shard_optimizer=true
    ;;
seq_profile)
    # Only the two Mamba-2 steps of the seq phase.
    profiled_one_gpu_32k
    profiled_seq2_32k
    ;;
seq_memory)
    gpu 0 run one_gpu_32k 200 $tp --cases lm_mamba2_130m_32k $steps --collectives
    run seq2_32k 150 $tp --cases lm_mamba2_130m_32k $steps --collectives --set $seq2
    # The two settings that split the arguments, profiled (is the parameters' all-gather exposed?),
    # then each under XLA's latency-hiding scheduler, which may start each block's all-gather
    # beside the other blocks' updates (shard_optimizer) or the previous block's forward (fsdp).
    for how in shard_optimizer fsdp; do
        run "seq2_32k_$how" 150 $tp --cases lm_mamba2_130m_32k $steps --collectives --profile 60 \
            --set $seq2 "mesh.$how=true"
        XLA_FLAGS=$lhs_flags run "seq2_32k_${how}_lhs" 150 $tp --cases lm_mamba2_130m_32k $steps \
            --set $seq2 "mesh.$how=true"
    done
    ;;
gather_seq | gather_dp)
    # Under shard_optimizer the updated parameters' all-gather ended the step exposed (0.96 ms on
    # seq=2, sixteenth session); gathered at the next step's start instead, XLA may run it beside
    # the forward.
    if [[ $phase == gather_seq ]]; then
        one="--cases lm_mamba2_130m_32k" two=$seq2 name=32k
    else
        one="--cases lm_mamba2_130m" two="mesh.data=2 data.batch_size=16" name=130m
    fi
    gpu 0 run "one_gpu_$name" 200 $tp $one $steps
    run "two_$name" 150 $tp $one $steps --collectives --set $two
    run "two_${name}_shard_optimizer" 150 $tp $one $steps --collectives --profile 60 \
        --set $two mesh.shard_optimizer=true
    run "two_${name}_gather_at_use" 150 $tp $one $steps --collectives --profile 60 \
        --set $two mesh.shard_optimizer=true mesh.param_gather=use
    ;;
seq_p2p)
    # Each SSD state and conv halo crosses between the shards as a small collective-permute whose
    # latency the seq=2 profiles show exposed; a copy between the GPUs skips NCCL's launch.
    gpu 0 run one_gpu_32k 200 $tp --cases lm_mamba2_130m_32k $steps
    p2p="--xla_gpu_use_memcpy_local_p2p=true"
    run seq2_32k 150 $tp --cases lm_mamba2_130m_32k $steps --collectives --set $seq2
    XLA_FLAGS=$p2p run seq2_32k_memcpy_p2p 150 $tp --cases lm_mamba2_130m_32k $steps --collectives \
        --profile 400 --set $seq2
    XLA_FLAGS=$p2p run seq2_32k_shard_optimizer_memcpy_p2p 150 $tp --cases lm_mamba2_130m_32k \
        $steps --collectives --set $seq2 mesh.shard_optimizer=true
    ;;
seq_latency)
    # The 96 collective-permutes of a seq=2 step are small and on the critical path: NCCL sends
    # messages over 16 KiB with its Simple protocol, whose latency the LL protocol undercuts.
    gpu 0 run one_gpu_32k 200 $tp --cases lm_mamba2_130m_32k $steps
    run seq2_32k 150 $tp --cases lm_mamba2_130m_32k $steps --collectives --profile 400 --set $seq2
    NCCL_P2P_LL_THRESHOLD=1048576 run seq2_32k_p2p_ll 120 $tp --cases lm_mamba2_130m_32k $steps \
        --profile 400 --set $seq2
    # XLA's latency-hiding scheduler (off by default on GPUs) may move independent work, such as
    # the weight gradients, between a collective-permute's start and its end.
    XLA_FLAGS=$lhs_flags run seq2_32k_lhs 150 $tp --cases lm_mamba2_130m_32k $steps --profile 400 \
        --set $seq2
    run seq2_32k_pgle 300 env JAX_ENABLE_PGLE=yes JAX_PGLE_PROFILING_RUNS=3 $tp \
        --cases lm_mamba2_130m_32k $steps --warmup 5 --set $seq2
    ;;
seq_ab)
    gpu 0 run one_gpu_32k 200 $tp --cases lm_mamba2_130m_32k $steps &
    gpu 1 run "one_gpu_32k_${bases[0]}" 200 $(base_tp "${bases[0]}") --cases lm_mamba2_130m_32k \
        $steps &
    wait
    run seq2_32k 150 $tp --cases lm_mamba2_130m_32k $steps --collectives --set $seq2
    for rev in "${bases[@]}"; do
        run "seq2_32k_$rev" 150 $(base_tp "$rev") --cases lm_mamba2_130m_32k $steps --collectives \
            --set $seq2
    done
    ;;
dp_ab)
    two="mesh.data=2 data.batch_size=16"
    gpu 0 run one_gpu_130m 130 $tp --cases lm_mamba2_130m $steps
    for round in 1 2; do  # the second round from the compilation cache
        run "data2_130m_r$round" 130 $tp --cases lm_mamba2_130m $steps --collectives --set $two
        for rev in "${bases[@]}"; do
            run "data2_130m_${rev}_r$round" 130 $(base_tp "$rev") --cases lm_mamba2_130m $steps \
                --collectives --set $two
        done
    done
    ;;
seq_hax_ab)
    # The seq=2 step of 1853cdc timed 304.75 and 315.43 ms where c626317's took 281.34 on the same
    # machine, yet 1853cdc's profile spanned 283 ms a step (BENCHMARKS, fifteenth session): both
    # numbers per row. (In the sixteenth session the two trees timed 294.09 and 294.49 ms on one
    # machine: the phase now shows how far one program's step moves between rows and rounds.)
    # Each tree ROUNDS times (default 2), in turn, the later rounds from the compilation cache
    # (about 40 s a row), so that the order the rows ran in (a GPU's warmth, a neighbour) shows as
    # the spread between rounds; the first round writes each tree's optimized HLO.
    hax="--cases lm_hax_mamba2_130m_64k --steps 20 --no-e2e --profile 400"  # options c626317 has
    hlo() { [[ $round == 1 ]] && echo "--hlo-dir $out/hlo_hax_seq2_$1"; }  # TREE: in round 1 only
    for round in $(seq "${ROUNDS:-2}"); do
        run "seq2_hax_64k_r$round" 330 $tp $hax $(hlo tree) --set $seq2
        for rev in "${bases[@]}"; do
            run "seq2_hax_64k_${rev}_r$round" 330 $(base_tp "$rev") $hax $(hlo "$rev") --set $seq2
        done
    done
    ;;
seq_hax)
    # Both HAX steps profiled with their HLOs, for bench/kernel_attribution.py (seq=2 took 1.50x
    # the one-GPU tokens/s and twice its memory in the sixth session): about 9 minutes, the 24-block
    # seq=2 program compiling in about 4 (LAYERS=4: about 2 minutes in all).
    layers="model.n_layer=${LAYERS:-24}"
    gpu 0 run one_gpu_hax_64k 300 $tp --cases lm_hax_mamba2_130m_64k --steps 10 --no-e2e \
        --collectives --profile 400 --hlo-dir "$out/hlo_hax_one" --set "$layers"
    run seq2_hax_64k 330 $tp --cases lm_hax_mamba2_130m_64k --steps 10 --no-e2e --collectives \
        --profile 400 --hlo-dir "$out/hlo_hax_seq2" --set "$layers" $seq2
    ;;
hax_64k)
    # The 24-block seq=2 step's first call after compiling once returned after 533.8 ms against
    # about 275 later: a full Python garbage collection in the timed steps (eighteenth session),
    # which train.py's loop and train_throughput.py now keep off the compiled step's objects.
    gpu 0 run one_gpu_hax_64k 250 $tp $hax_64k
    run seq2_hax_64k 330 $tp $hax_64k --set $seq2
    run seq2_hax_64k_no_warmup 100 $tp $hax_64k --warmup 0 --set $seq2
    ;;
hax_64k_apart)
    # 4 blocks ran 0.58 ms faster with the permutes apart (SendRecv exposed 0.52 against 1.13 ms on
    # GPU 0), within the spread; the 24-block pair had not been timed side by side.
    XLA_FLAGS=$permutes_apart \
        run seq2_hax_64k_permutes_apart 330 $tp $hax_64k --set $seq2
    gpu 0 run one_gpu_hax_64k_again 250 $tp $hax_64k
    run seq2_hax_64k_again 330 $tp $hax_64k --set $seq2
    ;;
hax_memory)
    # The 24-block seq=2 step peaked at 17.6 GiB a GPU against 10.8 on one GPU (forty-first
    # session; 11.9 against 11.5 in the twentieth), while with 4 blocks XLA's temporaries fell.
    mem="--cases lm_hax_mamba2_130m_64k --steps 3 --no-e2e --collectives"
    for combine in auto off; do
        run "seq2_hax_64k_combine_$combine" 280 $tp $mem --hlo-dir "$out/hlo_$combine" \
            --set $seq2 "mesh.combine_collectives=$combine"
    done
    ;;
hax_sched)
    # In each block's backward the first shard waits for the second (SendRecv exposed 1.21 ms of a
    # 4-block step on GPU 0, sixteenth session). XLA joins collective-permutes up to 30 MiB: the
    # SSD state's gradient travels in one with the carried keys' and values' (26 MiB), so it waits
    # for the second shard's sparse backward too, and in the forward the state goes in one with the
    # sparse branch's running sums, which the second shard's branch needs first. Then the
    # latency-hiding scheduler, which may run the first shard's other work beside the waits.
    hax="$hax_64k --collectives --profile 60"
    layers="model.n_layer=${LAYERS:-4}"
    run seq2_hax_64k 330 $tp $hax --set "$layers" $seq2
    XLA_FLAGS=$permutes_apart \
        run seq2_hax_64k_permutes_apart 330 $tp $hax --set "$layers" $seq2
    XLA_FLAGS=$lhs_flags run seq2_hax_64k_lhs 330 $tp $hax --set "$layers" $seq2
    ;;
pgle_seq | pgle_dp)
    # The scheduler's cost model takes a collective-permute of one SSD state for nearly free and
    # leaves it exposed; PGLE gives it the measured latencies of the step's own kernels.
    pgle="env JAX_ENABLE_PGLE=yes JAX_PGLE_PROFILING_RUNS=3"
    warm="--warmup 5"  # the profiled runs and the recompile, untimed
    if [[ $phase == pgle_seq ]]; then
        one="--cases lm_mamba2_130m_32k" two=$seq2
    else
        one="--cases lm_mamba2_130m" two="mesh.data=2 data.batch_size=16"
    fi
    gpu 0 run "${phase}_one_gpu" 200 $tp $one $steps $warm &
    gpu 1 run "${phase}_one_gpu_pgle" 300 $pgle $tp $one $steps $warm &
    wait
    run "${phase}_two" 150 $tp $one $steps --collectives $warm --set $two
    run "${phase}_two_pgle" 300 $pgle $tp $one $steps --collectives $warm --set $two
    ;;
nccl_dp)
    gpu 0 run one_gpu_130m 130 $tp --cases lm_mamba2_130m $steps
    run data2_130m 130 $tp --cases lm_mamba2_130m $steps --set mesh.data=2 data.batch_size=16
    for proto in Simple LL128; do
        NCCL_PROTO=$proto run "data2_130m_$proto" 100 $tp --cases lm_mamba2_130m $steps --profile 30 \
            --set mesh.data=2 data.batch_size=16
    done
    ;;
jr)
    # The cells' shapes (headdim 16, d_state 32) do not suit the Mosaic GPU chunk kernels, so
    # keeping custom calls out of the graphs buys them nothing and may cost launches.
    cells="--cases jr_mamba2_none,jr_mamba2_hax,jr_mamba_hax --steps 50"
    gpu 0 run jr_default 300 $tp $cells
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+CUSTOM_CALL gpu 0 run jr_custom_calls_in_graphs 300 \
        $tp $cells
    ;;
big_one)
    gpu 0 run one_gpu_1_3b 500 $tp --cases lm_mamba2_1_3b --steps 10 --no-e2e --set $big &
    gpu 1 run one_gpu_2_7b 500 $tp --cases lm_mamba2_2_7b --steps 10 --no-e2e --set $big &
    wait
    ;;
dp_flags)
    # data=2 under XLA flags that decide when the gradient all-reduces run: by default XLA combines
    # them into ~30 MiB buffers that each wait for the end of the backward.
    gpu 0 run one_gpu_130m 130 $tp --cases lm_mamba2_130m $steps
    run data2_130m 130 $tp --cases lm_mamba2_130m $steps --set mesh.data=2 data.batch_size=16
    for threshold in 0 4194304; do
        XLA_FLAGS="$lhs_flags --xla_gpu_all_reduce_combine_threshold_bytes=$threshold" \
            run "data2_lhs_$threshold" 130 $tp --cases lm_mamba2_130m $steps --collectives \
            --set mesh.data=2 data.batch_size=16
    done
    XLA_FLAGS="$lhs_flags --xla_gpu_all_reduce_combine_threshold_bytes=4194304 \
--xla_gpu_enable_highest_priority_async_stream=true" \
        run data2_lhs_4194304_priority 130 $tp --cases lm_mamba2_130m $steps \
        --set mesh.data=2 data.batch_size=16
    ;;
tp_2_7b | tp_1_3b)
    size=${phase#tp_}
    suffix=""
    if [[ ${LHS:-0} == 1 ]]; then export XLA_FLAGS="$lhs_flags"; suffix=_lhs; fi
    run "tensor2_$size$suffix" 500 $tp --cases "lm_mamba2_$size" --steps 10 --no-e2e --collectives \
        --set $big mesh.data=1 mesh.tensor=2
    ;;
threshold)
    # A joined all-reduce is copied into one buffer and sliced out after (dp_combine): with a small
    # threshold only the small gradients are joined; the large ones are reduced in place.
    gpu 0 run one_gpu_130m 130 $tp --cases lm_mamba2_130m $steps &
    gpu 1 run one_gpu_32k 200 $tp --cases lm_mamba2_130m_32k $steps &
    wait
    for case in "130m lm_mamba2_130m mesh.data=2 data.batch_size=16" "32k lm_mamba2_130m_32k $seq2"; do
        read -r name c two <<<"$case"
        run "two_$name" 150 $tp --cases "$c" $steps --collectives --set $two
        for mib in ${MIBS:-4}; do
            XLA_FLAGS="--xla_gpu_all_reduce_combine_threshold_bytes=$((mib << 20))" \
                run "two_${name}_${mib}mib" 150 $tp --cases "$c" $steps --collectives \
                --set $two mesh.combine_collectives=on
        done
    done
    ;;
graphs)
    # The data=2 step idles in many 5-7 us gaps (eighteenth session); XLA records fusions and
    # GEMMs into CUDA graphs but not, by default, collectives, which split the graphs.
    cb="--xla_gpu_enable_command_buffer=${GRAPHS:--CUSTOM_CALL,+COLLECTIVES}"
    gpu 0 run one_gpu_130m 130 $tp --cases lm_mamba2_130m $steps &
    XLA_FLAGS=$cb gpu 1 run one_gpu_130m_graphs 130 $tp --cases lm_mamba2_130m $steps &
    wait
    run two_130m 150 $tp --cases lm_mamba2_130m $steps --collectives --set mesh.data=2 data.batch_size=16
    XLA_FLAGS=$cb run two_130m_graphs 150 $tp --cases lm_mamba2_130m $steps --collectives \
        --set mesh.data=2 data.batch_size=16
    ;;
procs)
    # four windows each: the one-GPU baseline's two windows were 6% apart (eleventh session)
    mp="python bench/multiprocess_throughput.py --case ${CASE:-lm_mamba2_130m} --steps ${STEPS:-20} --windows 4"
    two=${TWO:-mesh.data=2 data.batch_size=16}
    limit=${LIMIT:-170}  # seconds a run; HAX at 64K compiles for about 150 s
    if ! [[ $limit =~ ^[1-9][0-9]*$ ]]; then
        echo "error: LIMIT must be a positive number of seconds, got '$limit'" >&2
        exit 2
    fi
    for r in ${RUNS:-one 1proc 2proc}; do
        case $r in
        one) gpu 0 run e2e_one_gpu "$limit" $mp --processes 1 ;;
        1proc) run e2e_1proc_two "$limit" $mp --processes 1 --set $two ;;
        2proc) run e2e_2proc_two $((limit + 30)) $mp --processes 2 --set $two ;;
        *) echo "error: RUNS holds '$r' (each of one, 1proc, 2proc)" >&2; exit 2 ;;
        esac
    done
    ;;
*)
    echo "error: unknown phase '$phase' (one of $phases)" >&2
    exit 2
    ;;
esac
echo "done $(date +%T)"
