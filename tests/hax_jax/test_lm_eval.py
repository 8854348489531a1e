"""The lm-evaluation-harness adapter: local YAML tasks over local JSONL, offline, against direct
sums."""

import json
import os

import numpy as np
import pytest
from mixer_testing import lm_logits
from scripts import load_script
from text_models import tiny_text_model

lm_eval = pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_eval.tasks import TaskManager  # noqa: E402

from hax_jax.evals import lm_eval_adapter  # noqa: E402
from hax_jax.evals.lm_eval_adapter import HaxJaxLM  # noqa: E402

eval_cli = load_script("eval.py", "eval_script")

QUESTIONS = [
    {"question": "The import statement", "choices": [" loads a module", " is blue"], "answer": 0},
    {"question": "A class definition", "choices": [" defines a class", " runs"], "answer": 1},
    {"question": "Comparisons", "choices": [" chain", " never", " sometimes"], "answer": 2},
]


def _task(tmp, name: str, output_type: str, body: str, rows: list[dict]) -> None:
    """A task YAML over a JSONL file in tmp."""
    data = tmp / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\noutput_type: {output_type}\n{body}"
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny model on three local tasks (multiple choice, rolling log-likelihood, generation)."""
    root = tmp_path_factory.mktemp("lm_eval")
    tiny = tiny_text_model(root)
    tasks = root / "tasks"
    tasks.mkdir()
    _task(
        tasks,
        "hax_mc",
        "multiple_choice",
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n",
        QUESTIONS,
    )
    _task(
        tasks,
        "hax_rolling",
        "loglikelihood_rolling",
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n',
        [{"text": tiny["corpus"].read_text()[i * 700 : i * 700 + 600]} for i in range(2)],
    )
    _task(
        tasks,
        "hax_gen",
        "generate_until",
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{choices[0]}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n'
        "metric_list:\n  - metric: exact_match\n",
        QUESTIONS,
    )
    lm = HaxJaxLM(path=str(tiny["ckpt"]), batch_size=2, max_length=64)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["hax_mc", "hax_rolling", "hax_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    return {**tiny, "lm": lm, "out": out}


def _logprob(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) from one full forward, in float64."""
    row = np.asarray(context + continuation)
    logits = np.asarray(lm_logits(model, row[None, :-1]))[0, :, :512].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    span = np.arange(len(context) - 1, len(row) - 1)
    return float(logp[span, row[span + 1]].sum())


def test_multiple_choice_loglikelihoods_equal_direct_sums(run):
    encode = run["lm"].tok_encode
    samples = run["out"]["samples"]["hax_mc"]
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        for (context, continuation), (logprob, _) in zip(
            sample["arguments"], [r[0] for r in sample["resps"]], strict=True
        ):
            whole, ctx = encode(context + continuation), encode(context)
            direct = _logprob(run["model"], ctx, whole[len(ctx) :])
            np.testing.assert_allclose(logprob, direct, rtol=1e-5, atol=1e-5)
    assert 0.0 <= run["out"]["results"]["hax_mc"]["acc,none"] <= 1.0


def test_rolling_loglikelihood_covers_every_token_once(run):
    """Windows of max_length = 64 tokens, the first conditioned on the end-of-text token."""
    samples = run["out"]["samples"]["hax_rolling"]
    for sample in samples:
        ids = run["lm"].tok_encode(sample["arguments"][0][0])
        assert len(ids) > 2 * 64  # several windows
        direct, seen = 0.0, [0]  # eos (id 0) first
        for start in range(0, len(ids), 64):
            chunk = ids[start : start + 64]
            context = ([0] + ids)[max(0, start + len(chunk) - 64) : start + 1]
            context = context if start else [0]
            direct += _logprob(run["model"], context, chunk)
            seen += chunk
        assert seen[1:] == ids
        np.testing.assert_allclose(sample["resps"][0][0], direct, rtol=1e-5)


def test_generate_until_is_greedy_generation_cut_at_newline(run):
    from hax_jax.generate import generate

    for sample in run["out"]["samples"]["hax_gen"]:
        prompt = sample["arguments"][0][0]
        ids = run["lm"].tok_encode(prompt)
        alone = generate(run["model"], np.asarray([ids]), 6, stop_tokens=[0])
        tokens = [t for t in alone.tokens[0, : alone.lengths[0]].tolist() if t != 0]
        expected = run["lm"].tok_decode(tokens).split("\n")[0]
        assert sample["resps"][0][0] == expected
    assert "exact_match,none" in run["out"]["results"]["hax_gen"]


def test_lm_eval_command_line_runs_the_registered_model(run, tmp_path, monkeypatch):
    """hax-jax-lm-eval = lm_eval's own command line, with the hax_jax model registered."""
    from hax_jax.evals.lm_eval_adapter import cli

    tasks = run["ckpt"].parent / "tasks"
    argv = ["hax-jax-lm-eval", "--model", "hax_jax"]
    argv += ["--model_args", f"path={run['ckpt']},max_length=64", "--tasks", "hax_mc"]
    argv += ["--include_path", str(tasks), "--output_path", str(tmp_path)]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as done:
        cli()
    assert not done.value.code
    written = json.loads(next(tmp_path.rglob("results*.json")).read_text())
    expected = run["out"]["results"]["hax_mc"]["acc,none"]
    assert written["results"]["hax_mc"]["acc,none"] == expected


def test_eval_py_runs_lm_eval_tasks_on_one_task_index(run, monkeypatch):
    """`eval.py CKPT --tasks lm_eval:a,lm_eval:b`: the results of lm_eval's own run, with the task
    index (it reads every YAML lm_eval ships) built once for the name check and both tasks."""
    built = []
    monkeypatch.setattr(
        lm_eval_adapter, "TaskManager", lambda **kw: built.append(kw) or TaskManager(**kw)
    )
    lm_eval_adapter.task_manager.cache_clear()
    tasks = str(run["ckpt"].parent / "tasks")
    argv = [str(run["ckpt"]), "--tasks", "lm_eval:hax_mc,lm_eval:hax_gen", "--lm-eval-include"]
    results = eval_cli.main([*argv, tasks, "--lengths", "64", "--batch-size", "2"])
    for name, metric in (("hax_mc", "acc,none"), ("hax_gen", "exact_match,none")):
        assert results[f"lm_eval:{name}"][metric] == run["out"]["results"][name][metric]
    assert built == [{"include_path": tasks}]


@pytest.mark.parametrize(
    "model_args, match",
    [
        ({"batch_sise": 4}, r"unknown model_args \['batch_sise'\] for the hax_jax model"),
        ({"batch_size": "auto"}, "batch_size must be a positive int .*, got 'auto'"),
        ({"batch_size": 0}, "batch_size must be a positive int .*, got 0"),
    ],
)
def test_bad_model_args_are_refused(model_args, match):
    """A misspelled model_arg or batch_size=auto is an error naming it (both were ignored: the
    batch size silently became 8), before any model is loaded."""
    with pytest.raises(ValueError, match=match):
        HaxJaxLM(path="/nonexistent", **model_args)
