"""RULER-style scores: RULER's metrics over ruler_tasks.py's prompts, and a runner over lengths.

Follows NVIDIA RULER (github.com/NVIDIA/RULER): scripts/eval/evaluate.py's postprocess_pred (control
characters become newlines, then the prediction is stripped; nothing is cut) and the metrics of
scripts/eval/synthetic/constants.py: string_match_all for niah, vt, cwe and fwe (the share of
references found in the prediction), string_match_part for qa (whether any reference is found), both
case-insensitive substring tests in percent, rounded to 2 decimals as RULER's are. The model is
reached only through `predict`, so this module never imports one.
"""

import re
from collections.abc import Callable, Sequence
from pathlib import Path

from hax_jax.evals import ruler_tasks

Predict = Callable[[list[str], int], list[str]]  # (prompts, max_new_tokens) -> completions
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f]")


def postprocess_pred(pred: str) -> str:
    """RULER's clean-up of a completion: control characters to newlines, then stripped."""
    return CONTROL_CHARACTERS.sub("\n", pred.strip()).strip()


def _check_pairs(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    """Raises ValueError unless there are as many predictions as reference lists, and some."""
    if not preds or len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions for {len(refs)} reference lists")


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over examples of the share of references that occur in the prediction, in percent."""
    _check_pairs(preds, refs)
    found = [
        sum(r.lower() in pred.lower() for r in ref) / len(ref)
        for pred, ref in zip(preds, refs, strict=True)
    ]
    return round(sum(found) / len(preds) * 100, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Percent of examples whose prediction contains any of their references."""
    _check_pairs(preds, refs)
    found = [
        max(r.lower() in pred.lower() for r in ref) for pred, ref in zip(preds, refs, strict=True)
    ]
    return round(sum(found) / len(preds) * 100, 2)


def metric(task: str) -> Callable[[Sequence[str], Sequence[Sequence[str]]], float]:
    """RULER's metric for a task: string_match_part for qa, string_match_all for the others."""
    if task not in ruler_tasks.TASKS:
        raise ValueError(
            f"unknown RULER task {task!r}; known tasks: {', '.join(ruler_tasks.TASKS)}"
        )
    return string_match_part if ruler_tasks.TASKS[task]["kind"] == "qa" else string_match_all


def score(task: str, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """The task's RULER score (0 to 100) of raw completions against their references."""
    return metric(task)([postprocess_pred(p) for p in preds], refs)


def run(
    task: str,
    predict: Predict,
    *,
    tokenizer,
    lengths: Sequence[int],
    num_examples: int,
    seed: int = 0,
    haystack_path: str | Path | None = None,
    qa_path: str | Path | None = None,
) -> dict:
    """Scores `predict` on `task` at each length: {"<length>": {"score", "examples"}, "score"}.

    predict gets each length's prompts (input + answer prefix) in one call with the task's
    max_new_tokens and returns one completion a prompt; "score" is the mean over lengths.
    """
    if not lengths:
        raise ValueError(f"lengths={lengths!r} names no context length")
    results = {}
    for length in lengths:
        examples = ruler_tasks.generate(
            task,
            tokenizer=tokenizer,
            length=length,
            num_examples=num_examples,
            seed=seed,
            haystack_path=haystack_path,
            qa_path=qa_path,
        )
        prompts = [e.input + e.answer_prefix for e in examples]
        preds = list(predict(prompts, examples[0].max_new_tokens))
        if len(preds) != len(prompts):
            raise ValueError(
                f"predict returned {len(preds)} completions for {len(prompts)} prompts"
            )
        value = score(task, preds, [e.outputs for e in examples])
        results[str(length)] = {"score": value, "examples": len(examples)}
    results["score"] = round(sum(r["score"] for r in results.values()) / len(results), 2)
    return results
