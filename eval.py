"""Evaluates a model: `python eval.py WORKDIR_OR_CHECKPOINT --tasks t1,t2,... [options]
[data.key=value ...]`.

Tasks:
  joint_recall, mqar          held-out split (--split valid|test) of the synthetic task; the run's
  data
                              settings, changed by data.* overrides (e.g.
                              data.joint_recall.n_context=4)
  niah_single_1 ... qa, ruler RULER-style tasks at --lengths tokens (ruler = all; qa needs --qa
  FILE),
                              greedy decoding, RULER's scores; --haystack FILE for the essay
                              haystacks
  perplexity                  exp(mean NLL) over --data (a .npy/.bin token file or text) in rows of
                              --lengths tokens
  longbench                   LongBench-format JSONL files (--longbench F1,F2), their metrics
  lm_eval:<task>              an lm-evaluation-harness task through the hax_jax adapter
                              (--lm-eval-include DIR for local task YAMLs)
Results are printed as a table and written as JSON keyed by task (--output).
"""

import argparse
import json
import sys
from pathlib import Path

from hax_jax import checkpoint
from hax_jax import config as config_lib
from hax_jax.data import text
from hax_jax.evals import heldout, longbench, results_table, ruler, ruler_tasks, text_model
from pallas_kernels.backend import keep_custom_calls_out_of_cuda_graphs

RULER_TASKS = tuple(ruler_tasks.TASKS)
TEXT_TASKS = (*RULER_TASKS, "ruler", "longbench")  # tasks that need a tokenizer
RULER = ("ruler", *RULER_TASKS)
# The options only some tasks read ("lm_eval:": every lm_eval task): given for none of --tasks, one
# would do nothing, so it is refused.
READ_BY = {
    "--split": ("joint_recall", "mqar"),
    **{flag: ("perplexity",) for flag in ("--data", "--token-dtype")},
    "--lengths": (*RULER, "perplexity", "longbench", "lm_eval:"),
    **{flag: RULER for flag in ("--num-examples", "--seed", "--haystack", "--qa")},
    "--longbench": ("longbench",),
    "--limit": ("longbench", "lm_eval:"),
    "--lm-eval-include": ("lm_eval:",),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; key=value words are collected as overrides."""
    parser = argparse.ArgumentParser(
        prog="eval.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an option is named whole, so that READ_BY sees it
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("path", help="a training workdir or a pretrained checkpoint directory")
    parser.add_argument("--tasks", required=True, help="comma-separated task names")
    parser.add_argument("--output", default="", help="write the results as JSON here")
    parser.add_argument("--lengths", default="4096", help="comma-separated token lengths")
    parser.add_argument("--tokenizer", default="", help="tokenizer directory (tokenizer.json)")
    parser.add_argument("--split", default="valid", help="joint_recall / mqar split")
    parser.add_argument("--data", default="", help="perplexity: token (.npy/.bin) or text file")
    parser.add_argument("--token-dtype", default="uint16", help="dtype of a raw .bin token file")
    parser.add_argument("--haystack", default="", help="RULER essay haystack text file")
    parser.add_argument("--qa", default="", help="RULER qa: a SQuAD or HotpotQA json file")
    parser.add_argument("--longbench", default="", help="comma-separated LongBench JSONL files")
    parser.add_argument("--lm-eval-include", default="", help="directory of lm_eval task YAMLs")
    parser.add_argument("--num-examples", type=int, default=25, help="RULER examples per length")
    parser.add_argument(
        "--limit", type=int, default=0, help="longbench / lm_eval examples (0 = all)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward / decode batch")
    parser.add_argument("--seed", type=int, default=0, help="RULER example seed")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if "=" not in o]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = overrides
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.lengths = [_positive(v, "--lengths") for v in args.lengths.split(",") if v]
    for flag, value, least in (
        ("--batch-size", args.batch_size, 1),
        ("--num-examples", args.num_examples, 1),
        ("--limit", args.limit, 0),
    ):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    for flag in sorted({word.partition("=")[0] for word in argv} & READ_BY.keys()):
        readers = READ_BY[flag]
        if not any(t in readers or f"{t.partition(':')[0]}:" in readers for t in args.tasks):
            names = ", ".join(r for r in readers if r not in RULER_TASKS).replace("ruler", "RULER")
            raise ValueError(
                f"{flag} is read by {names} only, not by --tasks {','.join(args.tasks)}"
            )
    return args


def _positive(value: str, flag: str) -> int:
    """An int > 0 from the command line, or a clear error."""
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{flag} takes positive integers, got {value!r}")
    return int(value)


def run(args: argparse.Namespace) -> dict:
    """Loads the model once and runs every task; returns {task: metrics}."""
    known = ("joint_recall", "mqar", "perplexity", *TEXT_TASKS)
    for task in args.tasks:
        if task not in known and not task.startswith("lm_eval:"):
            raise ValueError(f"unknown task {task!r}; known: {', '.join(known)}, lm_eval:<task>")
    _check_lm_eval_tasks(args)
    for override in args.overrides:
        if not override.startswith("data."):
            raise ValueError(f"eval.py takes data.* overrides only, got {override!r}")
    # A tokenizer asked for by name is used or refused, never replaced by the checkpoint's.
    if args.tokenizer and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {args.tokenizer!r} holds no tokenizer.json")
    model, cfg, tokenizer_dirs = checkpoint.load_for_eval(args.path)
    cfg = config_lib.apply_overrides(cfg, args.overrides)
    tokenizer = None
    needs_text = [t for t in args.tasks if _needs_text(t, args)]
    if needs_text:
        tokenizer = text.find_tokenizer(
            [args.tokenizer, *tokenizer_dirs], model.cfg.vocab_size, f"task {needs_text[0]!r}"
        )

    def predict(prompts: list[str], max_new_tokens: int) -> list[str]:
        """Greedy completions of the text tasks' prompts."""
        return text_model.complete(
            model, tokenizer, prompts, max_new_tokens, batch_size=args.batch_size
        )

    results = {}
    for task in args.tasks:
        if results:  # what is done so far survives a later task's failure
            _write(results, args.output)
        if task in ("joint_recall", "mqar"):
            results[task] = heldout.recall(
                model, cfg, task, split=args.split, batch_size=args.batch_size
            )
        elif task == "perplexity":
            if not args.data:
                raise ValueError("task 'perplexity' needs --data FILE (token or text file)")
            results[task] = {
                str(length): heldout.perplexity(
                    model,
                    args.data,
                    seq_len=length,
                    batch_size=args.batch_size,
                    tokenizer=tokenizer,
                    token_dtype=args.token_dtype,
                )
                for length in args.lengths
            }
        elif task in RULER_TASKS or task == "ruler":
            names = [task] if task != "ruler" else [t for t in RULER_TASKS if t != "qa" or args.qa]
            for name in names:
                results[name] = ruler.run(
                    name,
                    predict,
                    tokenizer=tokenizer,
                    lengths=args.lengths,
                    num_examples=args.num_examples,
                    seed=args.seed,
                    haystack_path=args.haystack or None,
                    qa_path=args.qa or None,
                )
        elif task == "longbench":
            if not args.longbench:
                raise ValueError("task 'longbench' needs --longbench FILE[,FILE] (JSONL)")
            results[task] = {}
            for path in args.longbench.split(","):
                results[task].update(
                    longbench.run(
                        path,
                        predict,
                        tokenizer=tokenizer,
                        max_length=max(args.lengths),
                        limit=args.limit,
                    )
                )
        else:
            results[task] = lm_eval_task(task.partition(":")[2], model, tokenizer, args)
    _write(results, args.output)
    return results


def _write(results: dict, output: str) -> None:
    """The results so far as JSON in `output` (if given), replaced whole (never half written)."""
    if not output:
        return
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=2) + "\n")
    partial.replace(path)


def _check_lm_eval_tasks(args: argparse.Namespace) -> None:
    """Every lm_eval:<task> names a task lm_eval knows, checked before the model loads."""
    names = [t.partition(":")[2] for t in args.tasks if t.startswith("lm_eval:")]
    if not names:
        return
    from hax_jax.evals.lm_eval_adapter import task_manager

    known = set(task_manager(args.lm_eval_include).all_tasks)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"lm_eval has no task {unknown[0]!r} (lm_eval --tasks list shows them)")


def _needs_text(task: str, args: argparse.Namespace) -> bool:
    """Whether `task` reads or writes text (so needs a tokenizer)."""
    if task == "perplexity":
        return Path(args.data).suffix not in heldout.TOKEN_SUFFIXES
    return task in TEXT_TASKS or task.startswith("lm_eval:")


def lm_eval_task(name: str, model, tokenizer, args: argparse.Namespace) -> dict:
    """One lm-evaluation-harness task through the adapter; its metrics as lm_eval reports them."""
    import lm_eval

    from hax_jax.evals.lm_eval_adapter import HaxJaxLM, task_manager

    lm = HaxJaxLM(
        loaded=(model, tokenizer), batch_size=args.batch_size, max_length=max(args.lengths)
    )
    manager = task_manager(args.lm_eval_include)  # the index the task names were checked in
    out = lm_eval.simple_evaluate(
        model=lm, tasks=[name], task_manager=manager, limit=args.limit or None
    )
    return {k: v for k, v in out["results"][name].items() if k != "alias"}


def main(argv: list[str]) -> dict:
    """Runs the tasks, prints the table, writes the JSON."""
    args = parse_args(argv)
    results = run(args)  # writes --output as each task completes
    print(results_table(results))
    return results


if __name__ == "__main__":
    keep_custom_calls_out_of_cuda_graphs()  # before JAX starts its GPU backend
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
