"""RULER-style tasks: prompts sized in tokens, oracle and random predictors, metrics, the runner."""

import json
import re
from collections import Counter

import numpy as np
import pytest
from text_models import pydoc_tokenizer

from hax_jax.evals import ruler as ruler_eval
from hax_jax.evals import ruler_tasks

SYNTHETIC = [task for task in ruler_tasks.TASKS if task != "qa"]
SQUAD = {
    "version": "v2.0",
    "data": [
        {
            "title": "Rivers",
            "paragraphs": [
                {
                    "context": "The Quillon river flows north through Vantara into the Merrow Sea.",
                    "qas": [
                        {
                            "question": "Which sea does the Quillon river flow into?",
                            "answers": [{"text": "the Merrow Sea"}, {"text": "Merrow Sea"}],
                            "is_impossible": False,
                        },
                        {
                            "question": "Which river flows south?",
                            "answers": [],
                            "is_impossible": True,
                        },
                    ],
                },
                {
                    "context": "Vantara's oldest bridge over the Quillon was finished in 1761.",
                    "qas": [
                        {
                            "question": "When was Vantara's oldest bridge finished?",
                            "answers": [{"text": "1761"}],
                        }
                    ],
                },
            ],
        },
        {
            "title": "Birds",
            "paragraphs": [
                {
                    "context": f"The zorvel is a small bird of the {place} that nests in reeds.",
                    "qas": [
                        {
                            "question": f"Where does the zorvel of the {place} nest?",
                            "answers": [{"text": f"reeds of the {place}"}],
                        }
                    ],
                }
                for place in ("Ostmark hills", "Pellucid coast", "Draymoor fens", "Kettle isles")
            ],
        },
    ],
}
HOTPOT = [
    {
        "question": f"Who founded the guild that built the {hall} hall?",
        "answer": founder,
        "context": [
            [f"{hall} hall", [f"The {hall} hall", f" was built by the {guild} guild."]],
            [f"{guild} guild", [f"The {guild} guild was founded by {founder}."]],
            [f"{hall} market", [f"The {hall} market sells cloth", " and dyed wool."]],
        ],
    }
    for hall, guild, founder in (
        ("Ambercroft", "Tessaline", "Orwen Baske"),
        ("Glimmerford", "Vossary", "Idra Fennick"),
        ("Harrowdeep", "Quellan", "Maro Stift"),
    )
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tokenizer, topics text file): a 1000-id BPE trained on the pydoc topics."""
    return pydoc_tokenizer(tmp_path_factory.mktemp("ruler"), 1000)


def count(tokenizer, prompt: str) -> int:
    """Tokens of a prompt, as the generator counts them."""
    return len(tokenizer.encode(prompt, add_special_tokens=False).ids)


def last_task(prompt: str, opening: str) -> str:
    """The prompt from the last occurrence of the template's opening (after any worked example)."""
    return prompt[prompt.rindex(opening) :]


def oracle(task: str, prompt: str) -> str:
    """The answer read from the prompt text alone (never from the example's outputs)."""
    kind = ruler_tasks.TASKS[task]["kind"]
    if kind == "niah":
        needles = re.findall(r"One of the special magic \w+ for ([\w-]+) is: ([\w-]+)\.", prompt)
        query = re.search(r"What (?:are all|is) the special magic \w+ for (.+?) mentioned", prompt)
        keys = re.split(r", and |, ", query.group(1))
        return " ".join(value for key in keys for k, value in needles if k == key)
    if kind == "vt":
        main = last_task(prompt, "Memorize and track")
        value = re.search(r"assigned the value (\d+) in the text above", main).group(1)
        found = {v for v, x in re.findall(r"VAR (\w+) = (\d+)", main) if x == value}
        for _ in range(10):  # follow the chain VAR B = VAR A, hop by hop
            found |= {b for b, a in re.findall(r"VAR (\w+) = VAR (\w+)", main) if a in found}
        return " ".join(sorted(found))
    if kind == "cwe":
        listed = last_task(prompt, "Below is a numbered list").split("\nQuestion:")[0]
        counts = Counter(re.findall(r"\d+\. (\S+)", listed))
        return " ".join(f"{i}. {w}" for i, (w, _) in enumerate(counts.most_common(10), 1))
    coded = prompt.split("coded words. ")[1].split("\nQuestion:")[0]
    counts = Counter(w for w in coded.split() if w != "...")
    return " ".join(w for w, _ in counts.most_common(3))


def random_predictor(seed: int = 0):
    """A predict() answering random words, numbers, uuids and variable names."""
    rng = np.random.default_rng(seed)

    def predict(prompts, max_new_tokens):
        """One random completion a prompt."""
        out = []
        for _ in prompts:
            words = list(rng.choice(ruler_tasks.CWE_WORDS, 6)) + list(
                rng.choice(ruler_tasks.WORD_KEYS, 2)
            )
            numbers = [str(x) for x in rng.integers(10**6, 10**7, 4)]
            names = ["".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5)) for _ in range(5)]
            out.append(" ".join(words + numbers + names + [str(rng.integers(10**4, 10**5))]))
        return out

    return predict


@pytest.mark.parametrize("task", SYNTHETIC)
def test_oracle_scores_100_and_random_near_0(setup, task):
    tokenizer, _ = setup
    calls = []

    def predict(prompts, max_new_tokens):
        """The oracle, recording its calls."""
        calls.append((len(prompts), max_new_tokens))
        return [oracle(task, p) for p in prompts]

    result = ruler_eval.run(task, predict, tokenizer=tokenizer, lengths=[1024], num_examples=4)
    assert json.loads(json.dumps(result)) == {
        "1024": {"score": 100.0, "examples": 4},
        "score": 100.0,
    }
    kind = ruler_tasks.TASKS[task]["kind"]
    assert calls == [(4, ruler_tasks.MAX_NEW_TOKENS[kind])]
    rand = ruler_eval.run(
        task, random_predictor(), tokenizer=tokenizer, lengths=[1024], num_examples=4
    )
    assert rand["score"] < 10 and (kind != "niah" or rand["score"] == 0)


@pytest.mark.parametrize("task", SYNTHETIC)
@pytest.mark.parametrize("length", [512, 4096])
def test_prompts_fill_the_token_budget(setup, task, length):
    tokenizer, _ = setup
    if task == "cwe" and length == 512:  # 10 words x 6 repeats need more with this tiny vocabulary
        with pytest.raises(ValueError, match=r"length=512 is too small .*'cwe'.* length=6\d\d"):
            ruler_tasks.generate(task, tokenizer=tokenizer, length=length, num_examples=1)
        return
    examples = ruler_tasks.generate(
        task, tokenizer=tokenizer, length=length, num_examples=2, seed=3
    )
    for i, e in enumerate(examples):
        budget = length - e.max_new_tokens
        assert (e.task, e.index) == (task, i)
        assert e.length == count(tokenizer, e.input + e.answer_prefix)
        assert 0.9 * budget <= e.length <= budget, (e.length, budget)
        assert e.answer_prefix and not e.input.endswith(e.answer_prefix)


def test_16k_niah_example_is_quick_and_holds_its_needle(setup, monkeypatch):
    """Fitting a 16K prompt tokenizes a few texts of about its size (measured: 3 calls, 1.03x its
    characters), not one text per trial length: bounded on the work done, not on wall-clock."""
    tokenizer, _ = setup
    work = {"calls": 0, "chars": 0}
    make_counter = ruler_tasks._token_counter

    def counting(tokenizer):
        count_tokens = make_counter(tokenizer)

        def counted(text):
            work["calls"] += 1
            work["chars"] += len(text)
            return count_tokens(text)

        return counted

    monkeypatch.setattr(ruler_tasks, "_token_counter", counting)
    (e,) = ruler_tasks.generate("niah_single_1", tokenizer=tokenizer, length=16384, num_examples=1)
    assert work["calls"] <= 8 and work["chars"] <= 4 * len(e.input), work
    assert 0.9 * (16384 - 128) <= e.length <= 16384 - 128
    assert re.search(rf"One of the special magic numbers for [\w-]+ is: {e.outputs[0]}\.", e.input)
    assert oracle("niah_single_1", e.input) == e.outputs[0]


def test_essay_haystack_from_a_local_file(setup):
    tokenizer, topics = setup
    examples = ruler_tasks.generate(
        "niah_multikey_1", tokenizer=tokenizer, length=2048, num_examples=2, haystack_path=topics
    )
    opening = " ".join(topics.read_text().split()[:12])
    for e in examples:
        assert opening in e.input and "The grass is green" not in e.input
        assert e.input.count("One of the special magic numbers for") == 4
    preds = [oracle("niah_multikey_1", e.input) for e in examples]
    assert ruler_eval.score("niah_multikey_1", preds, [e.outputs for e in examples]) == 100.0


def gold_answers(data) -> dict:
    """What the qa oracle knows of its file: question -> (answer, gold documents)."""
    if isinstance(data, list):  # HotpotQA
        docs = lambda d: [f"{title}\n{''.join(s)}" for title, s in d["context"]]  # noqa: E731
        return {d["question"]: (d["answer"], docs(d)) for d in data}
    paragraphs = [p for article in data["data"] for p in article["paragraphs"]]
    qas = [(q, p["context"]) for p in paragraphs for q in p["qas"] if q["answers"]]
    return {q["question"]: (q["answers"][0]["text"], [doc]) for q, doc in qas}


@pytest.mark.parametrize("data", [SQUAD, HOTPOT], ids=["squad", "hotpotqa"])
def test_qa_documents_oracle_and_random(setup, tmp_path, data):
    tokenizer, _ = setup
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(data))
    gold = gold_answers(data)
    examples = ruler_tasks.generate(
        "qa", tokenizer=tokenizer, length=1024, num_examples=5, qa_path=path
    )
    preds = []
    for e in examples:
        question = re.findall(r"\nQuestion: (.+)$", e.input)[-1]
        answer, documents = gold[question]
        assert all(f"Document {i}:\n" in e.input for i in range(1, 4))
        assert all(re.search(rf"Document \d+:\n{re.escape(d)}\n", e.input) for d in documents)
        assert e.length <= 1024 - 32 and e.answer_prefix == " Answer:"
        preds.append(answer)
    refs = [e.outputs for e in examples]
    assert ruler_eval.score("qa", preds, refs) == 100.0
    assert ruler_eval.score("qa", random_predictor()(preds, 32), refs) == 0.0
    assert len({re.findall(r"Question: (.+)", e.input)[-1] for e in examples}) > 1


def test_same_seed_same_prompts_other_seed_others(setup):
    tokenizer, _ = setup
    for task in ("niah_multikey_2", "vt", "cwe", "fwe"):
        make = lambda seed, task=task: ruler_tasks.generate(  # noqa: E731
            task, tokenizer=tokenizer, length=1024, num_examples=2, seed=seed
        )
        first, again, other = make(0), make(0), make(1)
        assert first == again
        assert [e.input for e in first] != [e.input for e in other]
        assert first[0].input != first[1].input


def test_tokenizer_truncation_is_ignored_and_kept(setup):
    tokenizer, _ = setup
    truncating = type(tokenizer).from_str(tokenizer.to_str())
    truncating.enable_truncation(64)
    (e,) = ruler_tasks.generate("niah_single_1", tokenizer=truncating, length=1024, num_examples=1)
    (plain,) = ruler_tasks.generate(
        "niah_single_1", tokenizer=tokenizer, length=1024, num_examples=1
    )
    assert e == plain and truncating.truncation["max_length"] == 64


def test_run_averages_lengths(setup):
    tokenizer, _ = setup
    half = lambda prompts, _: [oracle("vt", p).split()[0] for p in prompts]  # noqa: E731
    result = ruler_eval.run("vt", half, tokenizer=tokenizer, lengths=[512, 2048], num_examples=2)
    assert result == {
        "512": {"score": 20.0, "examples": 2},
        "2048": {"score": 20.0, "examples": 2},
        "score": 20.0,
    }


def test_bad_arguments_name_the_value(setup, tmp_path):
    tokenizer, _ = setup
    gen = lambda task="vt", **kw: ruler_tasks.generate(  # noqa: E731
        task, tokenizer=tokenizer, **{"length": 1024, "num_examples": 1, **kw}
    )
    with pytest.raises(ValueError, match=r"unknown RULER task 'niah'; known tasks: niah_single_1"):
        gen("niah")
    with pytest.raises(
        ValueError, match=r"length=100 is too small .*'vt'.*minimum is about length="
    ):
        gen(length=100)
    with pytest.raises(ValueError, match=r"length=300 is too small .*'niah_multikey_3'"):
        gen("niah_multikey_3", length=300)
    with pytest.raises(ValueError, match="num_examples=0 must be at least 1"):
        gen(num_examples=0)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        gen("niah_single_2", haystack_path=tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=r"task 'qa' needs qa_path: a local SQuAD or HotpotQA"):
        gen("qa")
    with pytest.raises(FileNotFoundError, match="squad.json"):
        gen("qa", qa_path=tmp_path / "squad.json")
    (tmp_path / "bad.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="bad.json' is neither SQuAD json nor a HotpotQA"):
        gen("qa", qa_path=tmp_path / "bad.json")
    with pytest.raises(ValueError, match=r"lengths=\[\] names no context length"):
        ruler_eval.run("vt", random_predictor(), tokenizer=tokenizer, lengths=[], num_examples=1)
    with pytest.raises(ValueError, match="predict returned 0 completions for 1 prompts"):
        ruler_eval.run("vt", lambda p, m: [], tokenizer=tokenizer, lengths=[512], num_examples=1)


def test_metrics_are_rulers():
    preds = ["  The numbers are 123 and 456.\x00", "nothing"]
    refs = [["123", "456", "789"], ["NOTHING", "x"]]
    assert ruler_eval.postprocess_pred(" a\tb\x01 \n") == "a\nb"
    assert ruler_eval.string_match_all(preds, refs) == round((2 / 3 + 1 / 2) / 2 * 100, 2)
    assert ruler_eval.string_match_part(preds, refs) == 100.0
    assert ruler_eval.score("qa", ["Paris."], [["paris", "lyon"]]) == 100.0
    assert ruler_eval.score("niah_multivalue", ["1 2"], [["1", "2", "3", "4"]]) == 50.0
    with pytest.raises(ValueError, match="2 predictions for 1 reference lists"):
        ruler_eval.string_match_all(["a", "b"], [["a"]])
