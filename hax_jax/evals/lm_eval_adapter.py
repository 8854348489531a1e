"""The lm-evaluation-harness model `hax_jax`: loglikelihood, loglikelihood_rolling, generate_until.

Importing this module registers the model with lm_eval (an optional dependency: the `eval` extra).
lm_eval 0.4 has no plugin entry points, so its own command line cannot import it: run
`hax-jax-lm-eval --model hax_jax --model_args path=DIR ...` (lm_eval's command line with the model
registered), `eval.py DIR --tasks lm_eval:<task>`, or `lm_eval.simple_evaluate(model="hax_jax",
...)`
after this import. model_args: path (a checkpoint or training workdir), tokenizer (a directory with
tokenizer.json; default: the model's own), batch_size, max_length (tokens a request is cut to, from
the left), max_gen_toks.
"""

import functools
import sys

try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.tasks import TaskManager
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError(
        "the lm-evaluation-harness adapter needs lm-eval: pip install 'hax-jax[eval]'"
    ) from err

from hax_jax import checkpoint
from hax_jax.data import text
from hax_jax.evals import text_model

# Keys lm_eval adds to every model's arguments (from its own flags), which this model ignores.
LM_EVAL_INJECTED = {"device", "max_batch_size"}


@register_model("hax_jax")
class HaxJaxLM(TemplateLM):
    """A hax_jax checkpoint as an lm_eval model (single process; batches sorted by length)."""

    def __init__(
        self,
        path: str = "",
        tokenizer: str = "",
        batch_size: int | str = 8,
        max_length: int = 2048,
        max_gen_toks: int = 256,
        loaded=None,
        **unused,
    ):
        """From `path` (and `tokenizer`), or from `loaded` = (model, tokenizer) already in memory.

        ValueError naming a model_arg this model does not know (a misspelling would otherwise be
        ignored) and a batch_size that is not a positive int ("auto" is HF's, not ours).
        """
        super().__init__()
        unknown = sorted(set(unused) - LM_EVAL_INJECTED)
        if unknown:
            raise ValueError(
                f"unknown model_args {unknown} for the hax_jax model; it takes path, tokenizer, "
                "batch_size, max_length, max_gen_toks"
            )
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ValueError(
                f"batch_size must be a positive int for the hax_jax model, got {batch_size!r}"
            )
        if loaded is not None:
            self.model, self.tokenizer = loaded
        else:
            if not path:
                raise ValueError("model_args needs path=<checkpoint or workdir>")
            self.model, _, tokenizer_dirs = checkpoint.load_for_eval(path)
            self.tokenizer = text.find_tokenizer(
                [tokenizer, *tokenizer_dirs], self.model.cfg.vocab_size, "the lm_eval adapter"
            )
        self.batch_size = int(batch_size)
        self._max_length, self.max_gen_toks = int(max_length), int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        """The end-of-text id (also the prefix of empty contexts and rolling windows)."""
        return text.eos_id(self.tokenizer)

    @property
    def max_length(self) -> int:
        """Tokens the model is given per request."""
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """Token ids of a string (no special tokens: the models are trained on raw text)."""
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens) -> str:
        """The string of token ids."""
        return self.tokenizer.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(log p, is greedy) of each (key, context ids, continuation ids), cut to max_length."""
        pairs = []
        for _, context, continuation in requests:
            keep = self.max_length + 1  # inputs are all but the last token
            whole = (context + continuation)[-keep:]
            n_cont = min(len(continuation), len(whole) - 1)
            pairs.append((whole[:-n_cont], whole[-n_cont:]))
        return text_model.loglikelihoods(self.model, pairs, batch_size=self.batch_size)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p of whole strings, over disjoint windows of max_length tokens (lm_eval's rule)."""
        pairs, owners = [], []
        for i, request in enumerate(requests):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(request.args[0]),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, windows):
                pairs.append((context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        scores = text_model.loglikelihoods(self.model, pairs, batch_size=self.batch_size)
        for owner, (logprob, _) in zip(owners, scores, strict=True):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, per gen_kwargs) continuations cut at the request's `until`
        strings."""
        out = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sampling = _sampling(kwargs)
            prompts = [requests[i].args[0] for i in indices]
            texts = text_model.complete(
                self.model,
                self.tokenizer,
                prompts,
                max_new,
                batch_size=self.batch_size,
                until=tuple(until),
                max_prompt_tokens=self.max_length - max_new,
                **sampling,
            )
            for i, completion in zip(indices, texts, strict=True):
                out[i] = completion
        return out


@functools.cache
def task_manager(include_path: str = "") -> TaskManager:
    """lm_eval's task index with the YAMLs of `include_path` ("" = none), built once a process: it
    reads every task YAML lm_eval ships (about 15,000 tasks, 9-10 s on a 2-core machine)."""
    return TaskManager(include_path=include_path or None)


def _sampling(gen_kwargs: dict) -> dict:
    """generate's sampling arguments from lm_eval's gen_kwargs (do_sample False = greedy)."""
    if not gen_kwargs.pop("do_sample", False):
        return {}
    return {
        "temperature": float(gen_kwargs.get("temperature", 1.0)),
        "top_k": int(gen_kwargs.get("top_k", 0) or 0),
        "top_p": float(gen_kwargs.get("top_p", 1.0)),
    }


def cli() -> None:
    """lm_eval's command line with the hax_jax model registered (`hax-jax-lm-eval`)."""
    from lm_eval.__main__ import cli_evaluate

    sys.exit(cli_evaluate())
