"""LongBench (v1 and LongBench-E) on local JSONL files: LongBench's prompts, truncation and metrics.

A file holds one example a line in LongBench's format (input, context, answers, length, dataset,
language, all_classes, _id); a directory is read as its *.jsonl files. Prompts follow
THUDM/LongBench's pred.py (config/dataset2prompt.json, the middle of an over-long prompt cut out, no
chat template: base models), scores its eval.py and metrics.py. The metrics are reimplemented
without LongBench's dependencies (rouge, fuzzywuzzy); the three Chinese datasets whose metrics
segment words with jieba are refused.
"""

import dataclasses
import difflib
import json
import re
import string
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

# LongBench's config/dataset2prompt.json, verbatim (typos included: the published scores used them).
DATASET2PROMPT = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",  # noqa: E501
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",  # noqa: E501
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",  # noqa: E501
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",  # noqa: E501
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',  # noqa: E501
    "passage_retrieval_zh": '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',  # noqa: E501
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# LongBench's config/dataset2maxlen.json: new tokens generated per answer.
DATASET2MAXLEN = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# Metric names of eval.py's dataset2metric; the jieba ones (word segmentation) are refused.
DATASET2METRIC = {
    **dict.fromkeys(
        ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"),
        "qa_f1",
    ),
    **dict.fromkeys(("gov_report", "qmsum", "multi_news", "samsum"), "rouge_l"),
    "trec": "classification",
    "lsht": "classification",
    "passage_retrieval_en": "retrieval",
    "passage_retrieval_zh": "retrieval_zh",
    "passage_count": "count",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
    "multifieldqa_zh": "qa_f1_zh",
    "dureader": "rouge_zh",
    "vcsum": "rouge_zh",
}
NEEDS_JIEBA = ("multifieldqa_zh", "dureader", "vcsum")
# The datasets of LongBench-E (pred.py --e), published as "<name>_e".
LONGBENCH_E = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
# eval.py scores only the first line of these few-shot answers (the model goes on with examples).
FIRST_LINE_ONLY = ("trec", "triviaqa", "samsum", "lsht")
# The paragraph an answer names ("Paragraph 3", "段落3"), as metrics.py's retrieval scores find it.
RETRIEVAL_PATTERNS = {"retrieval": r"Paragraph (\d+)", "retrieval_zh": r"段落(\d+)"}
PUNCTUATION = frozenset(string.punctuation)
LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")  # eval.py's scorer_e, over the "length" field (words)
Predict = Callable[[list[str], int], list[str]]


@dataclasses.dataclass(frozen=True)
class LongBenchExample:
    """One line of a LongBench file; `subset` keeps LongBench-E's "_e", `dataset` does not."""

    subset: str
    dataset: str
    input: str
    context: str
    answers: tuple[str, ...]
    all_classes: tuple[str, ...] | None
    length: int | None
    language: str
    id: str


def _dataset_names(field: str | None, file_stem: str) -> tuple[str, str]:
    """(subset, dataset) from a line's "dataset" field or the file; ValueError if unknown."""
    subset = str(field) if field else file_stem
    if subset in DATASET2PROMPT and file_stem == f"{subset}_e":
        subset = file_stem  # a LongBench-E file whose lines name the base dataset
    if subset in DATASET2PROMPT:
        return subset, subset
    if subset.endswith("_e") and subset[:-2] in LONGBENCH_E:
        return subset, subset[:-2]
    known = sorted(DATASET2PROMPT) + [f"{name}_e" for name in LONGBENCH_E]
    raise ValueError(f"unknown LongBench dataset {subset!r}; known: {', '.join(known)}")


def _example(record: dict, file_stem: str) -> LongBenchExample:
    """A LongBenchExample from one parsed line; ValueError naming a missing or mistyped field."""
    subset, dataset = _dataset_names(record.get("dataset"), file_stem)
    answers, classes = record.get("answers"), record.get("all_classes")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"'answers' must be a non-empty list of strings, got {answers!r}")
    for field in ("input", "context"):
        if not isinstance(record.get(field), str):
            raise ValueError(f"{field!r} must be a string, got {record.get(field)!r}")
    if record.get("length") is not None and not isinstance(record["length"], int):
        raise ValueError(f"'length' must be an integer, got {record['length']!r}")
    pattern = RETRIEVAL_PATTERNS.get(DATASET2METRIC[dataset])
    if pattern and not all(re.search(pattern, a) for a in answers):
        raise ValueError(f"{dataset} answers must name a paragraph ({pattern!r}), got {answers!r}")
    if DATASET2METRIC[dataset] == "classification" and not isinstance(classes, list):
        raise ValueError(f"{dataset} needs 'all_classes' (a list), got {classes!r}")
    return LongBenchExample(
        subset=subset,
        dataset=dataset,
        input=record["input"],
        context=record["context"],
        answers=tuple(answers),
        all_classes=tuple(classes) if isinstance(classes, list) else None,
        length=record.get("length"),
        language=record.get("language", ""),
        id=str(record.get("_id", "")),
    )


def load(path: str | Path) -> list[LongBenchExample]:
    """The examples of a LongBench JSONL file, or of every *.jsonl file of a directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"LongBench file {str(path)!r} does not exist")
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    examples = []
    for file in files:
        stem = file.name.split(".")[0]  # as eval.py names a dataset after its file
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict):
                        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                    examples.append(_example(record, stem))
                except ValueError as e:  # json.JSONDecodeError included
                    raise ValueError(f"{file}, line {number}: {e}") from None
    if not examples:
        raise ValueError(f"{str(path)!r} holds no LongBench examples")
    return examples


def format_prompt(example: LongBenchExample) -> str:
    """The dataset's LongBench prompt filled with the example's context and input (untruncated)."""
    return DATASET2PROMPT[example.dataset].format(context=example.context, input=example.input)


def truncate_middle(prompt: str, tokenizer, max_length: int) -> str:
    """`prompt` if it has at most max_length tokens, else its first and last max_length // 2 tokens.

    As pred.py: the middle goes, since instructions sit at both ends; each half is decoded on its
    own, so re-encoding may merge a token or two across the seam.
    """
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    if len(ids) <= max_length:
        return prompt
    half = max_length // 2
    return tokenizer.decode(ids[:half]) + tokenizer.decode(ids[-half:])


# --- metrics (LongBench metrics.py); each maps (prediction, one answer) to [0, 1] ---


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD's rule)."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    """Token-level F1 between the normalized prediction and answer."""
    predicted = normalize_answer(prediction).split()
    expected = normalize_answer(ground_truth).split()
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(expected)
    return 2 * precision * recall / (precision + recall)


def _lcs_words(reference: list[str], candidate: list[str]) -> set[str]:
    """The words of the longest common subsequence the rouge package's traceback finds."""
    table = [[0] * (len(candidate) + 1) for _ in range(len(reference) + 1)]
    for i, ref_word in enumerate(reference, start=1):
        for j, cand_word in enumerate(candidate, start=1):
            if ref_word == cand_word:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    words, i, j = set(), len(reference), len(candidate)
    while i > 0 and j > 0:
        if reference[i - 1] == candidate[j - 1]:
            words.add(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _sentences(text: str) -> list[str]:
    """The rouge package's preprocessing: split on ".", collapse whitespace inside each piece."""
    return [" ".join(piece.split()) for piece in text.split(".") if piece]


def rouge_l_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F as LongBench gets it from the `rouge` package (1.0.1): `Rouge().get_scores`'s
    "rouge-l" "f", a summary-level union LCS over "."-separated sentences with words counted once
    (its default exclusive=True); an empty side scores 0, as LongBench's bare except makes it.
    """
    hypothesis, reference = _sentences(prediction), _sentences(ground_truth)
    if not hypothesis or not reference:
        return 0.0
    hyp_words = {w for s in hypothesis for w in s.split(" ")}
    ref_words = {w for s in reference for w in s.split(" ")}
    union = set()
    for ref_sentence in reference:
        for hyp_sentence in hypothesis:
            union |= _lcs_words(ref_sentence.split(" "), hyp_sentence.split(" "))
    recall, precision = len(union) / len(ref_words), len(union) / len(hyp_words)
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


def classification_score(prediction: str, ground_truth: str, *, all_classes, **_) -> float:
    """1 / (classes named in the prediction) if the answer is among them, else 0.

    A named class that is a strict substring of the answer is dropped, in LongBench's loop that
    removes from the list it walks (so the element after a removal is skipped): reproduced as is.
    """
    named = [name for name in all_classes if name in prediction]
    index = 0
    while index < len(named):
        term = named[index]
        if term in ground_truth and term != ground_truth:
            named.remove(term)
        index += 1
    return 1.0 / len(named) if ground_truth in named else 0.0


def _fraction_equal(numbers: list[str], expected: str) -> float:
    """The fraction of the numbers found in a prediction that equal `expected` (0 if none)."""
    return sum(n == expected for n in numbers) / len(numbers) if numbers else 0.0


def _retrieval(prediction: str, ground_truth: str, pattern: str) -> float:
    """Fraction of the prediction's numbers equal to the paragraph number the answer names."""
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ValueError(f"answer {ground_truth!r} names no paragraph ({pattern!r})")
    return _fraction_equal(re.findall(r"\d+", prediction), found[0])


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """passage_retrieval_en: the answer is "Paragraph N"; the fraction of predicted numbers == N."""
    return _retrieval(prediction, ground_truth, RETRIEVAL_PATTERNS["retrieval"])


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """passage_retrieval_zh: the answer is "段落N"; the fraction of predicted numbers == N."""
    return _retrieval(prediction, ground_truth, RETRIEVAL_PATTERNS["retrieval_zh"])


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """passage_count: the fraction of the numbers in the prediction that equal the answer."""
    return _fraction_equal(re.findall(r"\d+", prediction), str(ground_truth))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's fuzz.ratio without python-Levenshtein: difflib's ratio in whole percent."""
    if a == b:  # its decorators: equal strings first, then an empty one
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """fuzz.ratio / 100 between the answer line and the prediction's first line with no comment
    or code fence (no "`", "#" or "//"); "" if there is none."""
    lines = prediction.lstrip("\n").split("\n")
    first = next((ln for ln in lines if not any(m in ln for m in ("`", "#", "//"))), "")
    return fuzz_ratio(first, ground_truth) / 100


METRICS = {
    "qa_f1": qa_f1_score,
    "rouge_l": rouge_l_score,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_zh_score,
    "count": count_score,
    "code_sim": code_sim_score,
}


def score_example(dataset: str, prediction: str, example: LongBenchExample) -> float:
    """eval.py's per-example score: the best over the answers, after its first-line cut."""
    if dataset in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric, classes = METRICS[DATASET2METRIC[dataset]], example.all_classes
    return max([0.0] + [metric(prediction, a, all_classes=classes) for a in example.answers])


def _check_scorable(dataset: str) -> None:
    """ValueError for the datasets whose LongBench metric needs jieba."""
    if dataset in NEEDS_JIEBA:
        raise ValueError(
            f"LongBench's {dataset} metric ({DATASET2METRIC[dataset]}) segments Chinese words with "
            "jieba, which hax-jax does not depend on; leave this dataset out"
        )


def _length_buckets(scores: list[float], examples: list[LongBenchExample]) -> dict:
    """scorer_e: scores by "length" (< 4000, < 8000, the rest); None where a bucket is empty."""
    buckets = {name: [] for name in LENGTH_BUCKETS}
    for score, example in zip(scores, examples, strict=True):
        if example.length is None:
            raise ValueError(f"LongBench-E example {example.id!r} has no 'length'")
        bucket = 0 if example.length < 4000 else 1 if example.length < 8000 else 2
        buckets[LENGTH_BUCKETS[bucket]].append(score)
    return {
        name: {"score": round(100 * float(np.mean(s)), 2) if s else None, "examples": len(s)}
        for name, s in buckets.items()
    }


def run(path: str | Path, predict: Predict, *, tokenizer, max_length: int, limit: int = 0) -> dict:
    """LongBench scores of `predict` on the file (or directory) at `path`, keyed by dataset.

    `predict(prompts, max_new_tokens)` returns one completion per prompt; it is called once per
    dataset. Prompts longer than max_length tokens lose their middle (truncate_middle); limit > 0
    keeps the first `limit` examples of each dataset. Each entry: score (0-100, as LongBench
    rounds it), examples, metric, truncated (prompts cut); LongBench-E ("_e") ones add by_length.
    """
    if max_length < 2:
        raise ValueError(f"max_length={max_length} must be >= 2 (half of it is kept at each end)")
    if limit < 0:
        raise ValueError(f"limit={limit} must be >= 0 (0: every example)")
    by_subset: dict[str, list[LongBenchExample]] = {}
    for example in load(path):
        by_subset.setdefault(example.subset, []).append(example)
    for examples in by_subset.values():
        _check_scorable(examples[0].dataset)  # before any generation is spent
    results = {}
    for subset, examples in by_subset.items():
        examples = examples[:limit] if limit else examples
        dataset = examples[0].dataset
        full = [format_prompt(e) for e in examples]
        prompts = [truncate_middle(p, tokenizer, max_length) for p in full]
        predictions = list(predict(prompts, DATASET2MAXLEN[dataset]))
        if len(predictions) != len(prompts) or not all(isinstance(p, str) for p in predictions):
            raise ValueError(
                f"predict returned {len(predictions)} items for {len(prompts)} {subset} prompts; "
                "it must return one string per prompt"
            )
        scores = [score_example(dataset, p, e) for p, e in zip(predictions, examples, strict=True)]
        results[subset] = {
            "score": round(100 * sum(scores) / len(scores), 2),
            "examples": len(examples),
            "metric": DATASET2METRIC[dataset],
            "truncated": sum(p != f for p, f in zip(prompts, full, strict=True)),
        }
        if subset != dataset:
            results[subset]["by_length"] = _length_buckets(scores, examples)
    return results
