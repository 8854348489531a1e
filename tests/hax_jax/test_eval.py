"""eval.py and hax_jax.evals: metrics against direct computations, a run's workdir, errors."""

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from mixer_testing import lm_logits
from scripts import load_script
from text_models import small_mamba2, tiny_text_model

from hax_jax import Config, save_pretrained
from hax_jax.data import pipeline, text
from hax_jax.evals import heldout, text_model

ROOT = Path(__file__).resolve().parents[2]


eval_cli = load_script("eval.py", "eval_script")

TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A perturbed 2-layer Mamba-2 over a 512-token BPE, saved with its tokenizer."""
    return tiny_text_model(tmp_path_factory.mktemp("tiny"))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis in float64."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _direct_nll(model, rows: np.ndarray) -> np.ndarray:
    """Per-token NLL of rows (r, L + 1) from log-softmax of one forward per row."""
    out = []
    for row in rows:
        logp = _log_softmax(np.asarray(lm_logits(model, row[None, :-1]))[0, :, :512])
        out.append(-logp[np.arange(len(row) - 1), row[1:]])
    return np.concatenate(out)


def _direct_mqar(model, cfg: Config, split: str) -> dict:
    """MQAR's metrics from one forward per row of the split's source: token accuracy (hits over
    all query positions), per-row accuracy averaged over rows, mean query-position NLL, rows."""
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, task="mqar"))
    source = pipeline.make_source(cfg, split, "")
    hits, nll, row_accuracy = [], [], []
    for i in range(len(source)):
        row = source[i]
        logits = np.asarray(lm_logits(model, row["inputs"][None]))[0]
        mask = row["loss_mask"].astype(bool)
        labels = row["labels"][mask]
        right = logits[mask].argmax(-1) == labels
        hits.append(right)
        nll.append(-_log_softmax(logits[mask])[np.arange(labels.size), labels])
        row_accuracy.append(right.mean())
    return {
        "accuracy": np.concatenate(hits).mean(),
        "example_accuracy": np.mean(row_accuracy),
        "loss": np.concatenate(nll).mean(),
        "examples": len(source),
    }


def _assert_mqar_equals_direct(model, cfg: Config, split: str) -> dict:
    """heldout.recall's MQAR metrics equal `_direct_mqar`'s; returns the direct ones."""
    got = heldout.recall(model, cfg, "mqar", split=split, batch_size=5)
    want = _direct_mqar(model, cfg, split)
    assert got["examples"] == want["examples"]
    for key in ("accuracy", "example_accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(got["loss"], want["loss"], **TOL)
    return want


def test_perplexity_is_exp_mean_token_nll(tiny, tmp_path):
    tokens = np.random.default_rng(0).integers(0, 512, 5 * 24 + 7).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    got = heldout.perplexity(tiny["model"], tmp_path / "tokens.npy", seq_len=24, batch_size=2)
    rows = np.stack([tokens[i * 24 : i * 24 + 25] for i in range(5)])  # the last 6 tokens unused
    nll = _direct_nll(tiny["model"], rows)
    assert got["tokens"] == nll.size == 5 * 24
    np.testing.assert_allclose(got["perplexity"], np.exp(nll.mean()), rtol=1e-5)


def test_loglikelihoods_equal_direct_computation(tiny):
    rng = np.random.default_rng(1)
    requests = [
        (rng.integers(0, 512, n).tolist(), rng.integers(0, 512, m).tolist())
        for n, m in ((5, 3), (40, 1), (1, 7), (70, 2), (12, 12))
    ]
    got = text_model.loglikelihoods(tiny["model"], requests, batch_size=2)
    for (context, continuation), (logprob, greedy) in zip(requests, got, strict=True):
        row = np.asarray(context + continuation)
        logp = _log_softmax(np.asarray(lm_logits(tiny["model"], row[None, :-1]))[0, :, :512])
        span = np.arange(len(context) - 1, len(row) - 1)
        np.testing.assert_allclose(logprob, logp[span, row[span + 1]].sum(), **TOL)
        assert greedy == bool(np.all(logp[span].argmax(-1) == row[span + 1]))
    assert not any(g for _, g in got)  # random continuations
    greedy_cont = [
        int(np.asarray(lm_logits(tiny["model"], np.asarray([[7, 8, 9]])))[0, -1, :512].argmax())
    ]
    assert text_model.loglikelihoods(tiny["model"], [([7, 8, 9], greedy_cont)])[0][1]


def test_complete_matches_generate_per_prompt(tiny):
    tokenizer = text.load_tokenizer(tiny["ckpt"])
    prompts = ["The import statement", "Comparisons", "A class definition defines a class object"]
    texts = text_model.complete(tiny["model"], tokenizer, prompts, 6, batch_size=2)
    from hax_jax.generate import generate

    for prompt, completion in zip(prompts, texts, strict=True):
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        alone = generate(tiny["model"], np.asarray([ids]), 6, stop_tokens=[0])
        expected = [t for t in alone.tokens[0, : alone.lengths[0]].tolist() if t != 0]
        assert completion == tokenizer.decode(expected)


def test_eval_cli_perplexity_on_text_and_table(tiny, tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text(tiny["corpus"].read_text()[:4000])
    out = tmp_path / "results.json"
    args = [str(tiny["ckpt"]), "--tasks", "perplexity", "--data", str(small), "--lengths", "32,64"]
    results = eval_cli.main([*args, "--output", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert set(results["perplexity"]) == {"32", "64"}
    assert "perplexity/64/perplexity" in capsys.readouterr().out
    # The text's token stream (each blank-line separated paragraph, then eos), cut into rows of
    # length + 1 tokens that overlap by one; each row is one forward from an empty context.
    tokenizer = tiny["tokenizer"]
    eos = tokenizer.token_to_id("<|endoftext|>")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", small.read_text()) if p.strip()]
    stream = np.concatenate([tokenizer.encode(p).ids + [eos] for p in paragraphs])
    for length in (32, 64):
        n_rows = (stream.size - 1) // length
        rows = np.stack([stream[i * length : i * length + length + 1] for i in range(n_rows)])
        nll = _direct_nll(tiny["model"], rows)
        got = results["perplexity"][str(length)]
        assert got["tokens"] == nll.size == n_rows * length
        np.testing.assert_allclose(got["nll"], nll.mean(), **TOL)
        np.testing.assert_allclose(got["perplexity"], np.exp(nll.mean()), **TOL)


def test_recall_tasks_equal_the_paper_metric(tiny):
    cfg = Config(model=tiny["model"].cfg)
    overrides = ["data.joint_recall.valid_size=12", "data.mqar.valid_size=12", "data.seq_len=64"]
    overrides.append("data.mqar.num_kv_pairs=8")
    cfg = eval_cli.config_lib.apply_overrides(cfg, overrides)
    got = heldout.recall(tiny["model"], cfg, "joint_recall", batch_size=5)
    source = pipeline.make_source(cfg, "valid", "")
    accs = []
    for i in range(len(source)):
        row = source[i]
        pred = np.asarray(lm_logits(tiny["model"], row["inputs"][None]))[0].argmax(-1)
        mask = row["loss_mask"].astype(bool)
        accs.append(np.mean(pred[mask] == row["labels"][mask]))
    assert got["examples"] == 12
    np.testing.assert_allclose(got["accuracy"], np.mean(accs), rtol=1e-6)
    assert _assert_mqar_equals_direct(tiny["model"], cfg, "test")["examples"] == 12


def test_mqar_metrics_equal_direct_computation_with_hits():
    """tiny's 512-token vocabulary leaves MQAR at zero hits; over 8 tokens (values 4..7) an
    untrained model gets some queries right, so the accuracies compare nonzero hit counts."""
    model = small_mamba2(8)
    model_cfg = model.cfg
    overrides = ["data.mqar.valid_size=20", "data.seq_len=16", "data.mqar.num_kv_pairs=2"]
    cfg = eval_cli.config_lib.apply_overrides(Config(model=model_cfg), overrides)
    for split in ("valid", "test"):
        want = _assert_mqar_equals_direct(model, cfg, split)
        assert want["examples"] == 20 and 0.0 < want["accuracy"] < 1.0


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--tasks", "bogus"], "unknown task 'bogus'"),
        (["--tasks", "perplexity"], "needs --data FILE"),
        (["--tasks", "joint_recall", "model.d_model=8"], "data.\\* overrides only"),
        (["--tasks", "joint_recall", "--lengths", "0"], "positive integers, got '0'"),
        (["--tasks", "joint_recall", "--split", "train"], "split='train'"),
        (
            ["--tasks", "joint_recall", "--batch-size", "0"],
            "--batch-size must be at least 1, got 0",
        ),
        (["--tasks", "ruler", "--num-examples", "-2"], "--num-examples must be at least 1, got -2"),
        (["--tasks", "longbench", "--limit", "-1"], "--limit must be at least 0, got -1"),
        # An option none of the tasks reads would do nothing: refused, naming its readers.
        (
            ["--tasks", "joint_recall", "--num-examples", "64"],
            "--num-examples is read by RULER only, not by --tasks joint_recall",
        ),
        (
            ["--tasks", "ruler,mqar", "--limit=3"],
            "--limit is read by longbench, lm_eval: only, not by --tasks ruler,mqar",
        ),
        (["--tasks", "perplexity", "--split", "test"], "--split is read by joint_recall, mqar"),
    ],
)
def test_eval_cli_errors_name_the_value(tiny, argv, match):
    with pytest.raises(ValueError, match=match):
        eval_cli.main([str(tiny["ckpt"]), *argv])


def test_an_abbreviated_option_is_not_taken(tiny, capsys):
    """Options are named whole (an abbreviation would slip past the check of who reads it)."""
    with pytest.raises(SystemExit):
        eval_cli.main([str(tiny["ckpt"]), "--tasks", "ruler", "--num-ex", "3"])
    assert "unrecognized arguments: --num-ex 3" in capsys.readouterr().err


def test_text_task_without_tokenizer_is_a_clear_error(tiny, tmp_path):
    bare = tmp_path / "bare"
    save_pretrained(tiny["model"], bare)
    with pytest.raises(ValueError, match="task 'niah_single_1' needs text, but the model has no"):
        eval_cli.main([str(bare), "--tasks", "niah_single_1", "--lengths", "512"])


def test_a_tokenizer_directory_without_tokenizer_json_is_refused(tiny, tmp_path):
    """--tokenizer names the tokenizer to use: a directory without one is an error, not a
    fallback to the checkpoint's tokenizer (tiny's has one)."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"--tokenizer '{tmp_path / 'empty'}' holds no"):
        argv = ["--tasks", "niah_single_1", "--lengths", "512", "--tokenizer"]
        eval_cli.main([str(tiny["ckpt"]), *argv, str(tmp_path / "empty")])


def test_decoding_long_ruler_prompts_on_cpu(tiny, tmp_path):
    results = eval_cli.main(
        [str(tiny["ckpt"]), "--tasks", "niah_single_1", "--lengths", "4096", "--num-examples", "2"]
    )
    assert results["niah_single_1"]["4096"]["examples"] == 2
    assert 0.0 <= results["niah_single_1"]["score"] <= 100.0


def test_workdir_eval_reads_the_best_checkpoint(tmp_path):
    workdir = tmp_path / "run"
    overrides = [
        f"workdir={workdir}",
        "train.num_steps=2",
        "train.eval_every=2",
        "train.progress=false",
        "data.batch_size=4",
        "mesh.data=1",
        "data.joint_recall.valid_size=8",
        "data.eval_batches=0",
        "model.block_pattern=mamba2",
        "model.n_layer=1",
    ]
    train = load_script("train.py", "train_script")
    logged = train.main([str(ROOT / "configs/tiny.py"), *overrides])
    results = eval_cli.main([str(workdir), "--tasks", "joint_recall", "--batch-size", "4"])
    got = results["joint_recall"]
    np.testing.assert_allclose(got["accuracy"], logged["valid_accuracy"], rtol=1e-6)
    np.testing.assert_allclose(got["loss"], logged["valid_loss"], rtol=1e-5)


def test_converted_model_perplexity_equals_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from hf_models import hf_mamba2

    from hax_jax import convert

    hf = hf_mamba2(tmp_path)
    hf.save_pretrained(tmp_path / "hf")
    convert.main([str(tmp_path / "hf"), str(tmp_path / "ckpt")])
    tokens = np.random.default_rng(3).integers(0, 64, 4 * 21 + 5).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    argv = ["--tasks", "perplexity", "--data", str(tmp_path / "tokens.npy"), "--lengths", "21"]
    ours = eval_cli.main([str(tmp_path / "ckpt"), *argv, "--batch-size", "3"])
    rows = torch.from_numpy(
        np.stack([tokens[i * 21 : i * 21 + 22] for i in range(4)]).astype(np.int64)
    )
    with torch.no_grad():
        logits = hf(rows[:, :-1]).logits.double()
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)
    )
    np.testing.assert_allclose(
        ours["perplexity"]["21"]["perplexity"], float(torch.exp(nll)), rtol=1e-4
    )


def test_eval_cli_longbench_file(tiny, tmp_path):
    rows = [
        {
            "input": "Who wrote it?",
            "context": "Guido wrote Python. " * 30,
            "answers": ["Guido"],
            "dataset": "hotpotqa",
            "all_classes": None,
            "length": 100,
            "_id": str(i),
        }
        for i in range(3)
    ]
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--tasks", "longbench", "--longbench", str(path), "--lengths", "128"]
    results = eval_cli.main([str(tiny["ckpt"]), *argv])
    assert results["longbench"]["hotpotqa"]["examples"] == 3
    assert results["longbench"]["hotpotqa"]["truncated"] == 3  # the context is longer than 128


def test_a_misspelled_lm_eval_task_is_refused_before_the_model_loads(tmp_path):
    """The path holds no checkpoint: the task name is checked first, so its error is the one."""
    with pytest.raises(ValueError, match="lm_eval has no task 'hellaswagg'"):
        eval_cli.main([str(tmp_path / "no_model"), "--tasks", "lm_eval:hellaswagg"])


def test_finished_tasks_are_written_before_a_later_task_fails(tiny, tmp_path):
    """--output holds each task's result as it completes: perplexity without --data fails after
    joint recall ran, and joint recall's result is in the file."""
    out = tmp_path / "results.json"
    argv = [str(tiny["ckpt"]), "--tasks", "joint_recall,perplexity", "--output", str(out)]
    with pytest.raises(ValueError, match="task 'perplexity' needs --data"):
        eval_cli.main([*argv, "data.joint_recall.valid_size=4"])
    written = json.loads(out.read_text())
    assert list(written) == ["joint_recall"] and 0.0 <= written["joint_recall"]["accuracy"] <= 1.0
