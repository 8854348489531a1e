"""Trains a model: `python train.py [configs/<name>.py[:arg]] [key=value ...]`.

Sharded over a ("data", "seq", "tensor") mesh, on grain data, with orbax checkpoints of state, data
iterator and config. A rerun with the same workdir resumes exactly; SIGTERM saves and exits; a
non-finite loss saves the last good state and stops. Metrics: workdir/metrics.jsonl, TensorBoard.
"""

import functools
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from hax_jax import checkpoint, distributed, heap, optim, parallel, sharding, training
from hax_jax import config as config_lib
from hax_jax.data import pipeline
from hax_jax.metrics import Metrics, ProgressBar, device_memory
from pallas_kernels.backend import keep_custom_calls_out_of_cuda_graphs

DEFAULT_CONFIG = "configs/main.py"


def resolve_config(argv: list[str]) -> config_lib.Config:
    """The config file (or the default) with the command line's key=value overrides applied."""
    path = argv[0] if argv and "=" not in argv[0] else DEFAULT_CONFIG
    overrides = argv[1:] if argv and "=" not in argv[0] else argv
    cfg = config_lib.apply_overrides(config_lib.load_config_file(path), overrides)
    if not cfg.workdir:
        name = Path(path.partition(".py")[0]).name + path.partition(".py")[2].replace(":", "_")
        cfg = config_lib.apply_overrides(cfg, [f"workdir=runs/{name}"])
    return cfg


def _model_inputs(cfg, batch: dict) -> dict:
    """Drops seq_idx unless the task packs documents and the config passes their boundaries."""
    packed = cfg.data.task in ("tokens", "text") and cfg.data.document_boundaries
    return {k: v for k, v in batch.items() if k != "seq_idx" or packed}


def main(argv: list[str]) -> dict:
    """Trains to train.num_steps (or to SIGTERM / a non-finite loss); returns the last metrics."""
    distributed.initialize()  # multi-process: one per host (or per GPU); see hax_jax/distributed
    cfg = resolve_config(argv)
    workdir = Path(cfg.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        trainer = Trainer(cfg, workdir, mesh)
        try:
            return trainer.run()
        finally:
            trainer.close()


class Trainer:
    """Builds (or restores) the state and the data iterator, then runs the loop."""

    def __init__(self, cfg: config_lib.Config, workdir: Path, mesh):
        self.cfg, self.workdir, self.mesh = cfg, workdir, mesh
        graphdef, abstract = nnx.split(checkpoint.abstract_model(cfg.model), nnx.Param)
        param_sh = training.param_shardings(abstract, mesh, cfg.mesh)
        tx = optim.make_optimizer(cfg.optim, cfg.train.num_steps)
        init = functools.partial(training.init_state, tx=tx, seed=cfg.seed)
        shape = jax.eval_shape(init, nnx.to_pure_dict(abstract))
        state_sh = training.state_shardings(shape, param_sh.rest, tx, mesh, param_sh.update)
        self.manager = checkpoint.train_checkpointer(workdir, cfg.train.keep_checkpoints)
        self.rules = sharding.rules(fsdp=cfg.mesh.fsdp)  # logical axes -> mesh axes
        self.rows = _process_rows(cfg, mesh, self.rules)
        self.iterator = iter(pipeline.train_dataset(cfg, str(workdir), self.rows))
        latest = self.manager.latest_step()
        if latest is None:
            params = training.init_params(cfg, graphdef, param_sh.rest)
            self.state = jax.jit(init, out_shardings=state_sh)(params)
            if distributed.is_main():
                config_lib.save_json(cfg, workdir / "config.json")
        else:  # resume exactly: the same model and data, the state and the iterator as saved
            saved = checkpoint.saved_config(self.manager, latest)
            checkpoint.check_resumable(saved, cfg, str(workdir))
            target = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shape, state_sh
            )
            self.state, self.iterator = checkpoint.restore_train(
                self.manager, latest, target, self.iterator
            )
        step = functools.partial(
            training.train_step,
            graphdef=graphdef,
            tx=tx,
            rank_loss_weight=cfg.model.sparse.rank_loss_weight,
            lr=optim.learning_rate(cfg.optim, cfg.train.num_steps),
            update_shardings=param_sh.update,
            use_shardings=param_sh.gathered,
            compute_dtype=cfg.model.dtype,
        )
        options = training.step_compiler_options(cfg.mesh, mesh, abstract, param_sh.use)
        self.step_fn = jax.jit(
            step, out_shardings=(state_sh, None), donate_argnums=0, compiler_options=options
        )
        self.eval_fn = jax.jit(functools.partial(training.eval_step, graphdef=graphdef))
        self.metrics = Metrics(workdir, resumed_at=latest)
        self.stop_requested = False

    def batch(self, rows: dict) -> dict:
        """Process-local numpy rows -> global arrays, batch over "data" and positions over "seq"."""
        rows = _model_inputs(self.cfg, rows)
        self.row_length = rows["inputs"].shape[1]
        model = self.cfg.model
        parallel.check_sequence_split(
            self.row_length, self.mesh.shape["seq"], model.mixer_kinds, model.mamba2.chunk_size
        )
        size, mesh = self.cfg.data.batch_size, self.mesh
        axes = {name: ("batch", "seq")[: value.ndim] for name, value in rows.items()}
        return {
            name: sharding.global_batch_array(value, self.rows, size, axes[name], mesh, self.rules)
            for name, value in rows.items()
        }

    def evaluate(self) -> dict:
        """valid_accuracy (the paper's per-sample mean, averaged) and valid_loss, valid split."""
        totals = None
        for rows in self.eval_rows:
            sums = self.eval_fn(self.state.params, self.batch(rows))
            totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
        totals = {k: _scalar(v) for k, v in totals.items()}
        return {
            "valid_accuracy": totals["accuracy_sum"] / max(totals["rows"], 1.0),
            "valid_loss": totals["nll_sum"] / max(totals["tokens"], 1.0),
        }

    def save(self, step: int) -> None:
        """A checkpoint at `step` unless one exists there already."""
        if self.manager.latest_step() != step:
            checkpoint.save_train(self.manager, step, self.state, self.iterator, self.cfg)

    def run(self) -> dict:
        """The loop: next batch -> dispatch step -> read the last step's metrics -> eval / save."""
        train = self.cfg.train
        step = _scalar(self.state.step, int)
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        last, pending = {}, None
        self.window = (time.perf_counter(), step)  # tokens/s over the steps since the last log
        progress = ProgressBar(train.progress, step, train.num_steps)
        with progress as bar, heap.frozen_after_compile() as freeze:
            while step < train.num_steps and not self.stop_requested:
                self.state, step_metrics = self.step_fn(self.state, self.batch(next(self.iterator)))
                freeze()  # once, after the first call compiled the step
                step += 1
                if pending is not None:
                    last = self._read(*pending, bar)
                pending = (step, step_metrics)
                done = step == train.num_steps
                if step % train.eval_every == 0 or done:
                    last, pending = self._read(*pending, bar), None
                    last = {**last, **self._evaluate_and_keep_best(step)}
                    self.window = (time.perf_counter(), step)
                if step % train.checkpoint_every == 0 or done:
                    self.save(step)
            if pending is not None:
                last = self._read(*pending, bar)
        if self.stop_requested:
            print(f"SIGTERM: saving step {step} and stopping", file=sys.stderr)
            self.save(step)
        self._wait_for_saves()
        self.metrics.close()
        signal.signal(signal.SIGTERM, previous)
        return last

    def _read(self, step: int, step_metrics, bar) -> dict:
        """Reads one step's metrics (waiting for it); logs them; stops on a non-finite loss."""
        values = {k: _scalar(v) for k, v in step_metrics.items()}
        if not np.isfinite(values["loss"]) or not np.isfinite(values["grad_norm"]):
            good = _scalar(self.state.step, int)  # updates stopped at the last finite step
            self.save(good)
            self._wait_for_saves()
            self.metrics.close()
            raise FloatingPointError(
                f"non-finite training loss {values['loss']} (grad norm {values['grad_norm']}) at "
                f"step {step}; saved the last good state (step {good}) in "
                f"{self.workdir}/checkpoints"
            )
        start, first = self.window
        values["tokens_per_s"] = (
            (step - first) * self.cfg.data.batch_size * self.row_length
        ) / max(time.perf_counter() - start, 1e-9)
        bar(step, values)
        if step % self.cfg.train.log_every == 0 or step == self.cfg.train.num_steps:
            values.update(device_memory())  # read on log steps only: it asks every device
            self.metrics.write(step, values)
            self.window = (time.perf_counter(), step)
        return values

    def _evaluate_and_keep_best(self, step: int) -> dict:
        """Validation metrics, logged; the parameters kept in workdir/best if they are the best."""
        values = self.evaluate()
        self.metrics.write(step, values)
        checkpoint.save_best(self.best, step, self.state.params, self.cfg, values)
        return values

    @functools.cached_property
    def eval_rows(self) -> list[dict]:
        """The validation batches, generated once (joint recall draws them by rejection: slow)."""
        limit = self.cfg.data.eval_batches
        return list(pipeline.eval_batches(self.cfg, str(self.workdir), "valid", limit, self.rows))

    @functools.cached_property
    def best(self):
        """The best-by-validation checkpoint manager."""
        return checkpoint.best_checkpointer(self.workdir)

    def _wait_for_saves(self) -> None:
        """Waits for the async saves (best too): one left mid-write stalls the others' barrier."""
        self.manager.wait_until_finished()
        if "best" in self.__dict__:  # the cached manager exists once an evaluation has run
            self.best.wait_until_finished()

    def close(self) -> None:
        """Ends the checkpoint managers' writer threads (bench/train_throughput.py reruns main)."""
        self.manager.close()
        if "best" in self.__dict__:
            self.best.close()

    def _on_sigterm(self, signum, frame) -> None:
        """Finish the current step, save, exit cleanly."""
        self.stop_requested = True


def _process_rows(cfg, mesh, rules) -> tuple[int, int]:
    """The rows of each global batch this process reads; an error unless "data" splits it whole."""
    size, data = cfg.data.batch_size, mesh.shape["data"]
    if size % data:
        auto = f" (mesh.data=-1 took all {data} devices)" if cfg.mesh.data == -1 else ""
        raise ValueError(f"data.batch_size={size} must be a multiple of mesh.data={data}{auto}")
    return sharding.process_rows(size, mesh, rules)


def _scalar(x, kind=float):
    """A host number from a (replicated) device scalar, also when not fully addressable."""
    return kind(np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x))


if __name__ == "__main__":
    keep_custom_calls_out_of_cuda_graphs()  # before JAX starts its GPU backend
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError, FloatingPointError, jax.errors.JaxRuntimeError) as err:
        sys.exit(training.error_line(err))
