"""Text through a tokenizer directory: train a byte-level BPE, tokenize text into token streams.

A tokenizer directory holds a `tokenizer.json` (the `tokenizers` library's format). A text file's
documents are its paragraphs: runs of lines separated by one or more blank lines, stripped of
surrounding whitespace; each is encoded on its own and followed by eos_id, so packed rows reset the
model's state between paragraphs (tokens.py). `tokenizers` is an optional dependency (the `text`
extra).

CLI: `python -m hax_jax.data.text FILE OUT_DIR --vocab-size N` trains a tokenizer into OUT_DIR.
"""

import argparse
import os
import re
from pathlib import Path

import numpy as np

# The one special token of a trained tokenizer: id 0, DataConfig.eos_id's default.
EOS_TOKEN = "<|endoftext|>"
BYTE_ALPHABET = 256  # a byte-level BPE starts from every byte


def _tokenizers():
    """The `tokenizers` module, or an ImportError that says how to install it."""
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(
            "text data needs the `tokenizers` package: pip install tokenizers "
            "(or pip install 'hax-jax[text]')"
        ) from e
    return tokenizers


def train_tokenizer(text_paths, out_dir: str | Path, vocab_size: int) -> Path:
    """Trains a byte-level BPE of vocab_size ids (eos = 0) on text files; returns tokenizer.json."""
    if vocab_size < BYTE_ALPHABET + 1:
        raise ValueError(
            f"vocab_size={vocab_size} is below the {BYTE_ALPHABET} bytes plus the eos token"
        )
    paths = [str(p) for p in ([text_paths] if isinstance(text_paths, str | Path) else text_paths)]
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"text file {path!r} does not exist")
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(paths, trainer)
    out = Path(out_dir) / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"tokenizer.{os.getpid()}.partial.json")
    tokenizer.save(str(partial))
    os.replace(partial, out)  # another process never reads half a file
    return out


def load_tokenizer(directory: str | Path):
    """The `tokenizers.Tokenizer` saved as directory/tokenizer.json."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer directory {str(directory)!r} has no tokenizer.json")
    return _tokenizers().Tokenizer.from_file(str(path))


# Files of a tokenizer directory that travel with a model (HF's names; only tokenizer.json is read).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def find_tokenizer(candidates, vocab_size: int, needed_by: str):
    """The first of `candidates` (directories) holding a tokenizer.json, checked against vocab_size.

    Raises ValueError naming `needed_by` (the task) and the places looked in when there is none.
    """
    looked = [str(c) for c in candidates if c]
    for directory in looked:
        if (Path(directory) / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(directory)
            check_vocab(tokenizer, vocab_size)
            return tokenizer
    raise ValueError(
        f"{needed_by} needs text, but the model has no tokenizer (looked in: "
        f"{', '.join(looked) or 'nowhere'}); "
        "pass --tokenizer DIR, a directory with a tokenizer.json "
        "(an HF model's, or one trained with python -m hax_jax.data.text)"
    )


def eos_id(tokenizer) -> int:
    """The end-of-text id: tokenizer_config.json's eos_token is not read, so the usual names are
    tried."""
    for name in (EOS_TOKEN, "</s>", "<eos>", "<|eot_id|>"):
        found = tokenizer.token_to_id(name)
        if found is not None:
            return found
    raise ValueError(
        f"the tokenizer has none of the end-of-text tokens {EOS_TOKEN!r}, '</s>', '<eos>'"
    )


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Raises ValueError when the tokenizer's ids do not all fit below the model's vocab_size."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(
            f"the tokenizer has {size} tokens but model.vocab_size={vocab_size}; use a tokenizer "
            "that fits or raise the vocabulary"
        )


def documents(text: str) -> list[str]:
    """The paragraphs of a text (blank-line separated, stripped, empty ones dropped)."""
    return [p.strip() for p in re.split(r"\n[ \t\r\f\v]*\n", text) if p.strip()]


def tokenize_file(text_path: str | Path, tokenizer, out_path: str | Path, eos_id: int) -> Path:
    """Writes a text file's token stream (each paragraph, then eos_id) as a uint16/uint32 .npy."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if not 0 <= eos_id < size:
        raise ValueError(f"eos_id={eos_id} is not an id of the tokenizer's {size} tokens")
    text_path = Path(text_path)
    if not text_path.is_file():
        raise FileNotFoundError(f"text file {str(text_path)!r} does not exist")
    docs = documents(text_path.read_text(encoding="utf-8"))
    if not docs:
        raise ValueError(f"text file {str(text_path)!r} holds no text")
    dtype = np.uint16 if size <= 2**16 else np.uint32
    ids = [np.asarray(e.ids + [eos_id], dtype) for e in tokenizer.encode_batch(docs)]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    np.save(out_path, np.concatenate(ids))
    return out_path


def write_pydoc_topics(out_path: str | Path) -> Path:
    """Writes CPython's pydoc help topics (465 K characters of English prose) as a text file."""
    from pydoc_data.topics import topics

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("\n\n".join(topics[k].strip() for k in sorted(topics)) + "\n")
    return out_path


def main(argv=None) -> None:
    """Trains a byte-level BPE tokenizer on a text file into a tokenizer directory."""
    parser = argparse.ArgumentParser(prog="python -m hax_jax.data.text", description=main.__doc__)
    parser.add_argument("file", help="UTF-8 text file to train on")
    parser.add_argument("out_dir", help="tokenizer directory to write (tokenizer.json)")
    parser.add_argument("--vocab-size", type=int, required=True, help="ids, eos and bytes included")
    args = parser.parse_args(argv)
    path = train_tokenizer([args.file], args.out_dir, args.vocab_size)
    print(f"wrote {path} ({load_tokenizer(args.out_dir).get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
