"""LongBench: metrics against hand-computed values, prompts, truncation, scoring files, errors."""

import json

import pytest
from text_models import pydoc_tokenizer

from hax_jax.evals import longbench as lb

TREC_CLASSES = ["Abbreviation", "Animal", "Color", "Other entity", "entity"]
CODE_LINE = "    return total + 1"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A 1000-id BPE trained on the pydoc topics text."""
    return pydoc_tokenizer(tmp_path_factory.mktemp("longbench_tok"), 1000)[0]


def _write(path, records):
    """Writes records as a JSONL file; returns its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _record(dataset, key, answer, *, context="", question="", length=1000, classes=None):
    """One LongBench line whose context starts with `key` (how the gold predictor knows it)."""
    return {
        "input": question,
        "context": f"{key} {context}",
        "answers": [answer],
        "length": length,
        "dataset": dataset,
        "language": "en",
        "all_classes": classes,
        "_id": key,
    }


def _files(tmp_path):
    """Small files for six English datasets; returns ({key: answer}, [paths])."""
    rows = {
        "hotpotqa": [("hp0", "Paris"), ("hp1", "Marie Curie")],
        "gov_report": [("gr0", "The agency spent more. Costs rose by half.")],
        "trec": [("tr0", "Animal"), ("tr1", "Other entity")],
        "passage_count": [("pc0", "3"), ("pc1", "12")],
        "passage_retrieval_en": [("pr0", "Paragraph 2"), ("pr1", "Paragraph 17")],
        "lcc": [("lc0", CODE_LINE)],
    }
    answers, paths = {}, []
    for dataset, items in rows.items():
        classes = TREC_CLASSES if dataset == "trec" else None
        records = [
            _record(dataset, k, a, question=f"question {k}?", classes=classes) for k, a in items
        ]
        paths.append(_write(tmp_path / f"{dataset}.jsonl", records))
        answers.update(items)
    return answers, paths


def _gold(answers, calls):
    """A predictor answering each prompt with the gold answer of the key found in it."""

    def predict(prompts, max_new_tokens):
        calls.append((prompts, max_new_tokens))
        return [next(a for k, a in answers.items() if k in p) for p in prompts]

    return predict


# --- metrics ---


def test_qa_f1_by_hand():
    # "cat sat" vs "cat sat down" after normalization: P = 1, R = 2/3, F1 = 0.8
    assert lb.qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    assert lb.qa_f1_score("The Cat, sat!", "cat sat") == pytest.approx(1.0)
    assert lb.qa_f1_score("dog", "cat") == 0.0
    assert lb.normalize_answer("  An Apple, the PIE. ") == "apple pie"


def test_rouge_l_by_hand():
    # LCS "police the gunman": 3 of 4 words on each side, F = 0.75
    assert lb.rouge_l_score("police killed the gunman", "police kill the gunman") == pytest.approx(
        0.75
    )
    # summary level: sentences "a b" and "c d" against "a c d e" share {a} and {c, d}: P = R = 3/4
    assert lb.rouge_l_score("a b. c d", "a c d e") == pytest.approx(0.75)
    # words counted once (the rouge package's default): P = 2/2, R = 2/3, F = 0.8
    assert lb.rouge_l_score("x y x y", "x y z") == pytest.approx(0.8)
    assert lb.rouge_l_score("same words here", "same words here") == pytest.approx(1.0)
    assert lb.rouge_l_score("", "anything") == 0.0
    assert lb.rouge_l_score("...", "anything") == 0.0  # no sentence left: the package raises


def test_classification_retrieval_count_by_definition():
    classes = TREC_CLASSES
    assert lb.classification_score("Animal", "Animal", all_classes=classes) == 1.0
    assert lb.classification_score("Animal or Color", "Animal", all_classes=classes) == 0.5
    assert lb.classification_score("Color", "Animal", all_classes=classes) == 0.0
    # "entity" is a strict substring of the answer "Other entity": dropped, not a second class
    assert lb.classification_score("Other entity", "Other entity", all_classes=classes) == 1.0
    assert lb.retrieval_score("Paragraph 4", "Paragraph 4") == 1.0
    assert lb.retrieval_score("Paragraph 4 or Paragraph 12", "Paragraph 4") == 0.5
    assert lb.retrieval_score("I do not know", "Paragraph 4") == 0.0
    assert lb.retrieval_zh_score("段落3", "段落3") == 1.0
    assert lb.count_score("There are 7 unique paragraphs", "7") == 1.0
    assert lb.count_score("7 or 8", "7") == 0.5
    assert lb.count_score("none", "7") == 0.0


def test_code_sim_skips_comments_and_fences():
    assert lb.code_sim_score(f"\n# the next line\n```python\n{CODE_LINE}\n", CODE_LINE) == 1.0
    # "return x" vs "return y": 7 of 8 characters match, ratio 14/16 -> fuzz.ratio 88 (rounded)
    assert lb.code_sim_score("// c\nreturn x", "return y") == 0.88
    assert lb.code_sim_score("# only a comment", "return y") == 0.0  # no line left: ""
    assert lb.fuzz_ratio("", "") == 100


# --- files, prompts, scores ---


def test_gold_scores_100_and_garbage_scores_low(tmp_path, tokenizer):
    answers, paths = _files(tmp_path)
    for path in paths:
        calls = []
        gold = lb.run(path, _gold(answers, calls), tokenizer=tokenizer, max_length=4000)
        (dataset,) = gold
        assert gold[dataset]["score"] == 100.0
        assert gold[dataset]["metric"] == lb.DATASET2METRIC[dataset]
        assert gold[dataset]["truncated"] == 0
        ((prompts, max_new_tokens),) = calls  # one call per dataset
        assert max_new_tokens == lb.DATASET2MAXLEN[dataset]
        assert gold[dataset]["examples"] == len(prompts)
        garbage = lb.run(
            path, lambda p, n: ["zzz qqq"] * len(p), tokenizer=tokenizer, max_length=4000
        )
        assert garbage[dataset]["score"] < 30, (dataset, garbage)


def test_prompts_use_the_dataset_template(tmp_path, tokenizer):
    answers, paths = _files(tmp_path)
    calls = []
    lb.run(tmp_path, _gold(answers, calls), tokenizer=tokenizer, max_length=4000)  # a directory
    phrases = {  # key prefix: the dataset's template
        "hp": "The following are given passages.",
        "gr": "Write a one-page summary of the report.",
        "tr": "Please determine the type of the question below.",
        "pc": "how many non-repeating paragraphs are there in total?",
        "pr": "Please determine which paragraph the abstract is from.",
        "lc": "Please complete the code given below.",
    }
    assert len(calls) == len(paths)
    for prompts, _ in calls:
        for prompt in prompts:
            key = next(k for k in answers if f"{k} " in prompt)
            assert phrases[key[:2]] in prompt
    example = lb.load(tmp_path / "hotpotqa.jsonl")[0]
    assert lb.format_prompt(example) == lb.DATASET2PROMPT["hotpotqa"].format(
        context="hp0 ", input="question hp0?"
    )


def test_long_prompts_lose_their_middle(tmp_path, tokenizer):
    filler = " ".join(f"passage {i} says nothing of interest." for i in range(400))
    path = _write(
        tmp_path / "hotpotqa.jsonl",
        [_record("hotpotqa", "hp0", "Paris", context=filler, question="Where is hp0?")],
    )
    calls = []
    result = lb.run(path, _gold({"hp0": "Paris"}, calls), tokenizer=tokenizer, max_length=64)
    assert result["hotpotqa"]["truncated"] == 1 and result["hotpotqa"]["score"] == 100.0
    (prompt,) = calls[0][0]
    full = lb.format_prompt(lb.load(path)[0])
    ids = tokenizer.encode(full, add_special_tokens=False).ids
    assert len(ids) > 64
    assert prompt == tokenizer.decode(ids[:32]) + tokenizer.decode(ids[-32:])
    assert prompt.startswith("Answer the question based on the given passages.")
    assert prompt.endswith("Question: Where is hp0?\nAnswer:")
    assert abs(len(tokenizer.encode(prompt, add_special_tokens=False).ids) - 64) <= 2
    assert lb.truncate_middle("short prompt", tokenizer, 64) == "short prompt"


def test_first_line_only_for_few_shot_datasets(tmp_path, tokenizer):
    path = _write(tmp_path / "trec.jsonl", [_record("trec", "tr0", "Animal", classes=TREC_CLASSES)])
    answer = "\nAnimal\nQuestion: What colour is the sky?\nType: Color"
    result = lb.run(path, lambda p, n: [answer], tokenizer=tokenizer, max_length=4000)
    assert result["trec"]["score"] == 100.0  # without the cut, "Color" would halve it


def test_longbench_e_length_buckets_and_limit(tmp_path, tokenizer):
    lengths = {"e0": 100, "e1": 3999, "e2": 4000, "e3": 9000}
    records = [_record("hotpotqa", k, "Paris", length=n) for k, n in lengths.items()]
    for record in records:
        del record["dataset"]  # named by the file: hotpotqa_e.jsonl
    path = _write(tmp_path / "hotpotqa_e.jsonl", records)
    answers = {"e0": "Paris", "e1": "London", "e2": "Paris", "e3": "Rome"}
    result = lb.run(path, _gold(answers, []), tokenizer=tokenizer, max_length=4000)
    assert result == {
        "hotpotqa_e": {
            "score": 50.0,
            "examples": 4,
            "metric": "qa_f1",
            "truncated": 0,
            "by_length": {
                "0-4k": {"score": 50.0, "examples": 2},
                "4-8k": {"score": 100.0, "examples": 1},
                "8k+": {"score": 0.0, "examples": 1},
            },
        }
    }
    json.dumps(result)  # JSON-ready
    limited = lb.run(path, _gold(answers, []), tokenizer=tokenizer, max_length=4000, limit=1)
    assert limited["hotpotqa_e"]["examples"] == 1
    assert limited["hotpotqa_e"]["by_length"]["8k+"] == {"score": None, "examples": 0}
    assert lb.load(path)[0].dataset == "hotpotqa"
    named = _write(tmp_path / "other.jsonl", [_record("hotpotqa_e", "e0", "Paris")])
    assert (lb.load(named)[0].subset, lb.load(named)[0].dataset) == ("hotpotqa_e", "hotpotqa")


def test_errors_name_the_value(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        lb.load(tmp_path / "nowhere.jsonl")
    good = json.dumps(_record("hotpotqa", "k", "a"))
    (tmp_path / "hotpotqa.jsonl").write_text(good + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2"):
        lb.load(tmp_path / "hotpotqa.jsonl")
    _write(tmp_path / "mystery.jsonl", [{**_record("hotpotqa", "k", "a"), "dataset": None}])
    with pytest.raises(ValueError, match="unknown LongBench dataset 'mystery'.*hotpotqa"):
        lb.load(tmp_path / "mystery.jsonl")
    _write(tmp_path / "bad.jsonl", [{**_record("hotpotqa", "k", "a"), "answers": "a"}])
    with pytest.raises(ValueError, match="line 1: 'answers'"):
        lb.load(tmp_path / "bad.jsonl")
    _write(tmp_path / "bad.jsonl", [_record("passage_retrieval_en", "k", "the second one")])
    with pytest.raises(ValueError, match="must name a paragraph.*the second one"):
        lb.load(tmp_path / "bad.jsonl")
    zh = _write(tmp_path / "dureader.jsonl", [_record("dureader", "k", "a")])
    calls = []
    with pytest.raises(ValueError, match="dureader.*jieba"):
        lb.run(zh, _gold({"k": "a"}, calls), tokenizer=tokenizer, max_length=64)
    assert not calls  # refused before any generation
    path = _write(tmp_path / "ok" / "hotpotqa.jsonl", [_record("hotpotqa", "k", "a")])
    with pytest.raises(ValueError, match="predict returned 0 items for 1"):
        lb.run(path, lambda p, n: [], tokenizer=tokenizer, max_length=64)
    with pytest.raises(ValueError, match="max_length=1"):
        lb.run(path, lambda p, n: p, tokenizer=tokenizer, max_length=1)
