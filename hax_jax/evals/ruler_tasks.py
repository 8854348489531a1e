"""RULER-style long-context synthetic tasks, generated locally and deterministically.

Follows NVIDIA RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", github.com/NVIDIA/RULER): the settings of scripts/synthetic.yaml (its qa_1 and
qa_2 are one `qa` task here, on a local SQuAD or HotpotQA file), the templates, answer prefixes and
new-token counts of scripts/data/synthetic/constants.py, and its generators (niah.py,
variable_tracking.py, common_words_extraction.py, freq_words_extraction.py, qa.py). A prompt (input
+ answer prefix) is sized in tokens of the given `tokenizers.Tokenizer` to fit `length` less the
task's new tokens. Nothing is downloaded: the "essay" haystack is a local text file's words (RULER:
Paul Graham's essays) or else the noise sentences, and words come from the lists below (RULER:
wonderwords). Scoring: hax_jax.evals.ruler.
"""

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = re.split(r"(?<=\.) ", NOISE)
DEPTHS = np.round(np.linspace(0, 100, num=40)).astype(int)  # RULER's essay needle depths (percent)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DOCUMENT = "Document {i}:\n{document}"
UPPERCASE = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
LOWERCASE = np.array(list("abcdefghijklmnopqrstuvwxyz"))

ADJECTIVES = """able angry bitter black blue bold brave bright broad broken busy calm careful cheap
clean clear clever cold cool crisp cruel curly dark deep dry dull eager early easy empty fair false
fancy fast fierce final firm flat fresh friendly full funny gentle giant glad gold good grand gray
great green happy hard heavy hidden high hollow honest hot huge humble icy kind large late lazy
little lively long loud lovely low lucky mad mild modern narrow neat new nice noble odd old open
pale plain polite poor proud pure purple quick quiet rapid rare raw red rich rough royal rude sad
safe sharp shiny short shy silent silly simple slow small smart smooth soft solid sour steep sticky
strange strict strong sudden sunny sweet swift tall tame thick thin tidy tiny tough true ugly vast
warm weak wet white wide wild wise wooden young yellow""".split()
NOUNS = """acorn actor airport album anchor angle animal ankle apple apron arrow artist autumn
avenue badge bakery balloon banana bandit barn basket beach beard bell bench berry bicycle blanket
bottle branch bread bridge brush bucket bundle butter button cabin cable camera camel candle canoe
canyon captain carpet carrot castle cattle cellar chair chalk cherry chimney circle city cliff clock
cloud coast coffee collar comet copper cottage cotton county cousin crayon cricket crown curtain
cushion daisy desert diamond dinner doctor dolphin donkey dragon drawer dream drum eagle engine
farmer feather fence finger forest fountain fox frog garden garlic ghost giraffe glacier glove goat
guitar hammer harbor harvest helmet hill honey horse island jacket jungle kettle kitchen kitten
ladder lake lantern lemon letter library lion lizard magnet mango maple market meadow melon mirror
monkey moon mountain muffin museum needle nest ocean office onion orange orchard owl paddle palace
panda parrot pearl pencil pepper piano pillow pirate planet pocket pond potato puzzle rabbit radio
rainbow raven ribbon river robot rocket saddle sailor salad sandal school shadow shell shovel silver
singer spider spoon squirrel stable star statue stone storm street sugar summer sunset swan table
teacher temple tiger tomato tower tractor train tree tulip tunnel turtle umbrella valley village
violin wagon walnut wheel whistle window winter wizard wolf yard zebra""".split()
VERBS = """accept admire answer argue arrive bake borrow bounce breathe build carry catch chase
cheer chew climb collect cook crawl cross dance deliver dig dive draw drift drink drive enjoy
explain fetch float fold follow gather glide grow guess hurry invent juggle jump knit knock laugh
learn lift listen march melt mend mix move nod obey paint pause plant play point polish pour pray
pull push race reach read repair rescue ride roll rush sail scrub search shake shout sing sit skate
sketch slide smile sneeze solve sort splash sprint squeeze stack steer stir swim swing talk teach
throw tickle travel trust tumble visit wander wash wave whisper wink wonder write yawn""".split()
WORD_KEYS = [f"{adjective}-{noun}" for adjective in ADJECTIVES for noun in NOUNS]  # RULER's keys
CWE_WORDS = sorted(set(NOUNS + ADJECTIVES + VERBS))  # cwe's words (then WORD_KEYS, if needed)

TEMPLATES = {  # (template, answer prefix): RULER's scripts/data/synthetic/constants.py
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
        "all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "vt": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
        "above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: ",
    ),
    "cwe": (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
        "common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "fwe": (
        "Read the following coded text and track the frequency of each coded word. Find the three "
        "most frequently appeared coded words. {context}\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
        "words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not "
        "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the "
        "question based on the given documents. Only give me the answer and do not output any "
        "other words.\n\nQuestion: {query}",
        " Answer:",
    ),
}
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


def _niah(haystack: str, key: str, value: str, num_k=1, num_v=1, num_q=1) -> dict:
    """A needle-in-a-haystack setting of RULER's synthetic.yaml."""
    return dict(kind="niah", haystack=haystack, key=key, value=value, k=num_k, v=num_v, q=num_q)


TASKS = {  # RULER's scripts/synthetic.yaml
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", num_v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", num_q=4),
    "vt": dict(kind="vt", num_chains=1, num_hops=4),
    "cwe": dict(kind="cwe", freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": dict(kind="fwe", alpha=2.0, coded_wordlen=6),
    "qa": dict(kind="qa"),
}
TASK_IDS = {name: i for i, name in enumerate(TASKS)}
FEW_SHOT_SHARE = 4  # vt's and cwe's worked example goes in when within 1/4 of the budget
VT_ICL_TOKENS = 500  # RULER sizes vt's worked example to 500 tokens


class RulerExample(NamedTuple):
    """One prompt: input + answer_prefix is what the model reads; outputs are the references."""

    task: str
    index: int
    input: str
    answer_prefix: str
    outputs: list[str]
    length: int  # tokens of input + answer_prefix
    max_new_tokens: int


class _Context(NamedTuple):
    """What a task's maker needs besides its setting."""

    entropy: tuple  # (seed, task id, length, example index)
    budget: int  # prompt tokens allowed: length - max new tokens
    count: Callable[[str], int]
    words: list[str]  # the essay haystack's words
    qa: tuple | None  # (questions, documents) of the qa file

    def rng(self, purpose: int, n: int = 0) -> np.random.Generator:
        """A generator for one purpose of this example (fixed-length entropy: no aliasing)."""
        return np.random.default_rng([*self.entropy, purpose, n])


def _token_counter(tokenizer) -> Callable[[str], int]:
    """Counts a text's tokens (no special tokens) without the tokenizer's truncation or padding."""
    if getattr(tokenizer, "truncation", None) or getattr(tokenizer, "padding", None):
        tokenizer = type(tokenizer).from_str(tokenizer.to_str())  # a copy: the caller's is kept
        tokenizer.no_truncation()
        tokenizer.no_padding()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def _fit(make, count, budget: int, n_min: int, n_max: int | None = None, start=None):
    """(n, make(n), tokens) for nearly the largest n in [n_min, n_max] whose prompt fits budget.

    tokens > budget only when n_min does not fit. Tokens grow close to linearly in n, so secant
    steps from the smallest prompt stop within 1% of the budget after a few tokenizations (RULER
    binary-searches, tokenizing the whole prompt about log2(n) times).
    """

    def measure(n):
        """n, its example and the tokens of its prompt."""
        made = make(n)
        return n, made, count(made[0] + made[1])

    lo = base = measure(n_min)
    hi, overshoots = None, 0
    n = start if start is not None and start > n_min else 2 * n_min + 16  # a small probe
    for _ in range(64 if lo[2] <= budget else 0):  # each step narrows (lo, hi); 64 is a backstop
        n = n if n_max is None else min(n, n_max)
        if n <= lo[0]:
            break
        point = measure(n)
        if point[2] <= budget:
            lo, overshoots = point, 0
        else:
            hi, overshoots = point, overshoots + 1
        if budget - lo[2] <= budget // 100 or (hi and hi[0] - lo[0] <= 1) or lo[0] == n_max:
            break
        a, b = (lo, hi) if hi else (base, lo)
        rate = (b[2] - a[2]) / (b[0] - a[0])  # tokens per unit
        n = lo[0] + (max(1, int((budget - lo[2]) / rate)) if rate > 0 else 16)
        if hi:  # stay inside; bisect when interpolation keeps landing past the budget
            n = min(n, hi[0] - 1, (lo[0] + hi[0]) // 2 if overshoots >= 2 else hi[0])
    return lo


def _distinct(draw: Callable[[], str], k: int) -> list[str]:
    """k different draws, in the order drawn."""
    out = []
    while len(out) < k:
        if (item := draw()) not in out:
            out.append(item)
    return out


def _random(kind: str, rng: np.random.Generator, taken=()) -> str:
    """A random 7-digit number, adjective-noun word or uuid (RULER's needle parts) not in taken."""
    while True:
        if kind == "numbers":
            item = str(rng.integers(10**6, 10**7))
        elif kind == "words":
            item = WORD_KEYS[rng.integers(len(WORD_KEYS))]
        else:
            item = str(uuid.UUID(bytes=rng.bytes(16), version=4))
        if item not in taken:
            return item


def _interleave(units: list[str], items: list[str], fractions) -> list[str]:
    """units with items[j] put before unit int(fractions[j] * len(units)); fractions ascending."""
    slots = [int(f * len(units)) for f in fractions]
    out, j = [], 0
    for i, unit in enumerate(units):
        while j < len(items) and slots[j] <= i:
            out.append(items[j])
            j += 1
        out.append(unit)
    return out + items[j:]


def _noise_lines(n: int) -> list[str]:
    """n noise sentences as RULER's noise lines (five sentences each; the last may be partial)."""
    full, rest = divmod(n, len(NOISE_SENTENCES))
    return [NOISE] * full + ([" ".join(NOISE_SENTENCES[:rest])] if rest else [])


def _sentences(words: list[str], n: int) -> list[str]:
    """The first n words of the essay (repeated as needed), as sentences."""
    if n > len(words):
        words = words * (n // len(words) + 1)
    out, start = [], 0
    for i in range(n):
        if words[i][-1] in ".!?":
            out.append(" ".join(words[start : i + 1]))
            start = i + 1
    return out + ([" ".join(words[start:n])] if start < n else [])


def _singular(text: str) -> str:
    """RULER's rewording of the niah template for one answer."""
    for plural, one in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(plural, one)
    return text


def _niah_maker(spec: dict, ctx: _Context):
    """make(n, top_up=0): the niah prompt with n haystack units (and top_up noise sentences)."""
    rng = ctx.rng(0)
    plural, key_kind = spec["value"], spec["key"]
    keys = _distinct(lambda: _random(key_kind, rng), max(spec["k"], spec["q"]))
    values = [[_random(plural, rng) for _ in range(spec["v"])] for _ in keys]
    needle = lambda key, value: NEEDLE.format(type_needle_v=plural, key=key, value=value)  # noqa: E731
    needles = [needle(k, v) for k, vs in zip(keys, values, strict=True) for v in vs]
    needles = [needles[i] for i in rng.permutation(len(needles))]
    if spec["haystack"] == "essay":
        fractions = np.sort(rng.choice(DEPTHS, len(needles), replace=False)) / 100
    else:
        fractions = np.sort(rng.random(len(needles)))
    queried = rng.choice(len(keys), spec["q"], replace=False)
    queries = [keys[i] for i in queried]
    answers = [v for i in queried for v in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    template, prefix = TEMPLATES["niah"]
    type_needle_v = plural
    if spec["q"] * spec["v"] == 1:
        template, prefix, type_needle_v = _singular(template), _singular(prefix), plural[:-1]

    def make(n: int, top_up: int = 0):
        """The prompt with n haystack units: noise sentences, essay words or distractor needles."""
        if spec["haystack"] == "essay":
            context = " ".join(_interleave(_sentences(ctx.words, n), needles, fractions))
        else:
            if spec["haystack"] == "noise":
                units = _noise_lines(n)
            else:  # distractor needles, never with a queried key
                r = ctx.rng(1)  # one stream: n + 1 distractors extend n's (smooth growth)
                units = [needle(_random(key_kind, r, keys), _random(plural, r)) for _ in range(n)]
            # a needle line can be ~90 tokens; noise sentences fill what whole lines cannot
            context = "\n".join(_interleave(units, needles, fractions) + _noise_lines(top_up))
        fill = dict(type_needle_v=type_needle_v, query=query)
        return template.format(context=context, **fill), prefix.format(**fill), answers

    return make, 0, None


def _vt_make(spec: dict, rng: np.random.Generator, name_len: int, head: str):
    """make(n): a variable-tracking prompt (after head) with its chains among n noise sentences."""
    hops, num_chains = spec["num_hops"], spec["num_chains"]
    names = _distinct(lambda: "".join(rng.choice(UPPERCASE, name_len)), num_chains * (hops + 1))
    values = rng.choice(90000, num_chains, replace=False) + 10000
    items, fractions = [], []
    for c in range(num_chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        items += [f"VAR {chain[0]} = {values[c]}"]
        items += [f"VAR {chain[j + 1]} = VAR {chain[j]} " for j in range(hops)]
        fractions += sorted(rng.random(hops + 1))  # a chain's lines keep their order
    order = np.argsort(fractions, kind="stable")
    items, fractions = [items[i] for i in order], np.asarray(fractions)[order]
    template, prefix = TEMPLATES["vt"]
    fill = dict(query=str(values[0]), num_v=hops + 1)

    def make(n: int):
        """The prompt with n noise sentences."""
        context = "\n".join(_interleave(_noise_lines(n), items, fractions))
        text = head + template.format(context=context, **fill)
        return text, prefix.format(**fill), names[: hops + 1]

    return make


def _vt_maker(spec: dict, ctx: _Context):
    """make(n) for vt, led by RULER's worked example (3-letter names) when it fits."""
    icl_budget = min(VT_ICL_TOKENS, ctx.budget // FEW_SHOT_SHARE)
    icl_make = _vt_make(spec, ctx.rng(2), 3, "")
    _, (icl, icl_prefix, icl_answer), tokens = _fit(icl_make, ctx.count, icl_budget, 0)
    head = icl + icl_prefix + " " + " ".join(icl_answer) + "\n\n" if tokens <= icl_budget else ""
    return _vt_make(spec, ctx.rng(0), 5, head), 0, None


def _cwe_words(rng: np.random.Generator) -> list[str]:
    """cwe's word order: the single words shuffled, then (for long lists) shuffled compounds."""
    singles = [CWE_WORDS[i] for i in rng.permutation(len(CWE_WORDS))]
    return singles + [WORD_KEYS[i] for i in rng.permutation(len(WORD_KEYS))]


def _cwe_list(rng: np.random.Generator, words: list[str], counts: tuple[int, int], num_cw: int):
    """RULER's numbered list: words[:num_cw] counts[0] times each, the others counts[1] times."""
    listed = words[:num_cw] * counts[0] + words[num_cw:] * counts[1]
    listed = [listed[i] for i in rng.permutation(len(listed))]
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(listed))


def _cwe_maker(spec: dict, ctx: _Context):
    """make(n) for cwe over n distinct words, led by RULER's worked example when it fits."""
    shot_size, shot_counts, counts = 20, (3, 1), (6, 1)  # RULER's below 4K tokens
    if ctx.entropy[2] >= 4096:
        shot_size, shot_counts, counts = 40, (10, 3), (spec["freq_cw"], spec["freq_ucw"])
    num_cw = spec["num_cw"]
    template, prefix = TEMPLATES["cwe"]
    shot_rng = ctx.rng(2)
    shot_words = _cwe_words(shot_rng)[:shot_size]
    shot = template.format(context=_cwe_list(shot_rng, shot_words, shot_counts, num_cw))
    shot += prefix + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_words[:num_cw]))
    head = shot + "\n" if ctx.count(shot) <= ctx.budget // FEW_SHOT_SHARE else ""
    # a fixed word order, so n + 1 words add one word to n's (tokens grow smoothly in n)
    words = _cwe_words(ctx.rng(0))

    def make(n: int):
        """The prompt listing n distinct words."""
        text = _cwe_list(ctx.rng(1, n), words[:n], counts, num_cw)
        return head + template.format(context=text), prefix, words[:num_cw]

    return make, num_cw, len(words)


def _zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha > 1) as scipy's: a partial sum and the integral of its tail."""
    tail = (terms + 0.5) ** (1 - alpha) / (alpha - 1)  # the sum past `terms`, as an integral
    return float(np.sum(np.arange(1.0, terms + 1) ** -alpha)) + tail


def _fwe_maker(spec: dict, ctx: _Context):
    """make(n) for fwe: about n coded words with zeta(alpha) frequencies; '...' is the top one."""
    rng = ctx.rng(0)
    size = max(5, ctx.budget // 50)  # RULER: vocab of (max_seq_length - new tokens) // 50
    codes = rng.choice(LOWERCASE, (4 * size, spec["coded_wordlen"]))
    vocab = ["..."] + list(dict.fromkeys("".join(code) for code in codes))[: size - 1]
    ranks = np.arange(1, len(vocab) + 1, dtype=np.float64)
    weights = ranks ** -spec["alpha"] / _zeta(spec["alpha"])
    template, prefix = TEMPLATES["fwe"]

    def make(n: int):
        """The prompt of about n coded words."""
        words = np.repeat(np.array(vocab, dtype=object), (n * weights).astype(int))
        words = words[ctx.rng(1, n).permutation(len(words))]
        return template.format(context=" ".join(words)), prefix, vocab[1:4]

    return make, 100, None  # from 100 words on, the top three counts are distinct


def _load_qa(path: Path) -> tuple[list[dict], list[str]]:
    """(questions, documents) of a SQuAD (v1/v2) or HotpotQA json file, read as RULER's qa.py."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "data" in data:  # SQuAD: a question's article is its distractors
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        ids = {doc: i for i, doc in enumerate(docs)}
        qas = []
        for article in data["data"]:
            article_docs = [ids[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                gold = ids[p["context"]]
                more = [i for i in article_docs if i != gold]
                for q in p["qas"]:
                    if not q.get("is_impossible") and q["answers"]:
                        outs = [a["text"] for a in q["answers"]]
                        qas.append(dict(query=q["question"], outputs=outs, gold=[gold], more=more))
    elif isinstance(data, list):  # HotpotQA: all of a question's context paragraphs go in
        docs = sorted({f"{t}\n{''.join(ss)}" for d in data for t, ss in d["context"]})
        ids = {doc: i for i, doc in enumerate(docs)}
        qas = []
        for d in data:
            gold = list(dict.fromkeys(ids[f"{t}\n{''.join(ss)}"] for t, ss in d["context"]))
            qas.append(dict(query=d["question"], outputs=[d["answer"]], gold=gold, more=[]))
    else:
        raise ValueError(f"qa file {str(path)!r} is neither SQuAD json nor a HotpotQA json list")
    if not qas:
        raise ValueError(f"qa file {str(path)!r} has no answerable questions")
    return qas, docs


def _qa_maker(spec: dict, ctx: _Context):
    """make(n): a question's gold documents and n distractors, shuffled (RULER's qa.py)."""
    qas, docs = ctx.qa
    # one question order per seed, so every length asks the same questions (as RULER does)
    order = np.random.default_rng([*ctx.entropy[:2], 0, 0, 0, 0]).permutation(len(qas))
    qa = qas[order[ctx.entropy[3] % len(qas)]]
    rng = ctx.rng(0)
    taken = set(qa["gold"]) | set(qa["more"])
    others = [i for i in range(len(docs)) if i not in taken]
    pool = [int(i) for part in (qa["more"], others) for i in rng.permutation(part)] or qa["gold"]
    template, prefix = TEMPLATES["qa"]

    def make(n: int):
        """The prompt with n distractor documents (repeated when the file runs out)."""
        chosen = qa["gold"] + [pool[i % len(pool)] for i in range(n)]
        chosen = [chosen[i] for i in ctx.rng(1, n).permutation(len(chosen))]
        parts = [DOCUMENT.format(i=i, document=docs[d]) for i, d in enumerate(chosen, 1)]
        return template.format(context="\n\n".join(parts), query=qa["query"]), prefix, qa["outputs"]

    return make, 0, None


MAKERS = dict(niah=_niah_maker, vt=_vt_maker, cwe=_cwe_maker, fwe=_fwe_maker, qa=_qa_maker)


def generate(
    task: str,
    *,
    tokenizer,
    length: int,
    num_examples: int,
    seed: int = 0,
    haystack_path: str | Path | None = None,
    qa_path: str | Path | None = None,
) -> list[RulerExample]:
    """num_examples prompts of `task`, each within length - max_new_tokens tokens; seeded.

    Tokens are counted without special tokens (a BOS the caller adds is one more). haystack_path:
    a text file whose words make the essay haystack (else the noise sentences); qa_path: a SQuAD or
    HotpotQA json file, needed by `qa`.
    """
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known tasks: {', '.join(TASKS)}")
    if num_examples < 1:
        raise ValueError(f"num_examples={num_examples} must be at least 1")
    if seed < 0:
        raise ValueError(f"seed={seed} must be a non-negative integer")
    spec = TASKS[task]
    if spec["kind"] == "qa" and qa_path is None:
        raise ValueError(
            f"task {task!r} needs qa_path: a local SQuAD or HotpotQA json file "
            "(RULER downloads them; nothing is downloaded here)"
        )
    for path, what in ((haystack_path, "haystack file"), (qa_path, "qa file")):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    words = Path(haystack_path).read_text().split() if haystack_path is not None else NOISE.split()
    if not words:
        raise ValueError(f"haystack file {str(haystack_path)!r} has no words")
    qa = _load_qa(Path(qa_path)) if spec["kind"] == "qa" else None
    max_new = MAX_NEW_TOKENS[spec["kind"]]
    count, budget = _token_counter(tokenizer), length - max_new
    examples, start = [], None
    for index in range(num_examples):
        ctx = _Context((seed, TASK_IDS[task], length, index), budget, count, words, qa)
        make, n_min, n_max = MAKERS[spec["kind"]](spec, ctx)
        n, made, tokens = _fit(make, count, budget, n_min, n_max, start)
        if tokens > budget:
            raise ValueError(
                f"length={length} is too small for RULER task {task!r}: its smallest prompt "
                f"(template and needles) takes {tokens} tokens plus {max_new} new tokens; the "
                f"minimum is about length={tokens + max_new} (random needles vary in tokens)"
            )
        if spec.get("haystack") == "needle":  # top up what whole needle lines leave
            _, made, tokens = _fit(lambda m, make=make, n=n: make(n, m), count, budget, 0)
        start = n
        text, prefix, outputs = made
        examples.append(RulerExample(task, index, text, prefix, list(outputs), tokens, max_new))
    return examples
