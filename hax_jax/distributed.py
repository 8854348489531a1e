"""Multi-process runs: start `jax.distributed` from the environment, write shared files once.

Started by hand (one process per GPU or host), every process gets JAX_COORDINATOR_ADDRESS
(host:port of process 0), JAX_NUM_PROCESSES and its own JAX_PROCESS_ID. On a cluster JAX detects
by itself (SLURM, Open MPI, a multi-host TPU slice) none of them is needed.
"""

import os

import jax
from jax.experimental import multihost_utils

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _cluster_detected() -> bool:
    """Whether this process runs under a launcher that jax.distributed detects, with several
    processes: SLURM, Open MPI, or the workers of a multi-host TPU slice."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env:
        return True
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return True
    return "," in env.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in env


def initialize() -> None:
    """jax.distributed.initialize from JAX_* variables, or by detection on a cluster; a single
    process otherwise. ValueError naming the variable that is missing or not a number."""
    if jax.distributed.is_initialized():
        return
    if "JAX_COORDINATOR_ADDRESS" not in os.environ:
        if _cluster_detected():
            jax.distributed.initialize()
        return
    values = {}
    for name in ENV_VARS[1:]:
        raw = os.environ.get(name)
        if raw is None or not raw.strip().isdigit():
            raise ValueError(
                f"JAX_COORDINATOR_ADDRESS is set, so {name} must be a non-negative integer, got "
                f"{raw!r} (set {', '.join(ENV_VARS)} for every process)"
            )
        values[name] = int(raw)
    count, index = values["JAX_NUM_PROCESSES"], values["JAX_PROCESS_ID"]
    if count < 1 or index >= count:
        raise ValueError(
            f"JAX_PROCESS_ID={index} must be below JAX_NUM_PROCESSES={count} (ids 0 ... count - 1)"
        )
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=count,
        process_id=index,
    )


def is_main() -> bool:
    """Whether this process writes the files every process shares (config, tokenizer)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (a no-op in a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
