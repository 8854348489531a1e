"""Text: byte-level BPE training, paragraph documents, token streams for tokens.py, the CLI."""

import sys

import numpy as np
import pytest

from hax_jax.data import text, tokens

TEXT = "The first paragraph,\non two lines.\n\n  \nA second one.\n\n\n\nThe third: é ü 東京.\n"


@pytest.fixture(scope="module")
def pydoc_tokenizer(tmp_path_factory):
    """A 400-id BPE trained on the pydoc topics demo text."""
    root = tmp_path_factory.mktemp("pydoc")
    corpus = text.write_pydoc_topics(root / "pydoc.txt")
    text.train_tokenizer([corpus], root / "tok", 400)
    return text.load_tokenizer(root / "tok"), corpus


def test_documents_are_paragraphs():
    assert text.documents(TEXT) == [
        "The first paragraph,\non two lines.",
        "A second one.",
        "The third: é ü 東京.",
    ]


def test_train_tokenize_and_read_back(tmp_path, pydoc_tokenizer):
    tokenizer, corpus = pydoc_tokenizer
    assert tokenizer.get_vocab_size() == 400 and tokenizer.token_to_id(text.EOS_TOKEN) == 0
    assert len(corpus.read_text()) > 400_000
    (tmp_path / "small.txt").write_text(TEXT)
    out = text.tokenize_file(tmp_path / "small.txt", tokenizer, tmp_path / "small.npy", eos_id=0)
    stream = np.load(out)
    assert stream.dtype == np.uint16 and stream[-1] == 0 and np.sum(stream == 0) == 3
    docs = np.split(stream, np.flatnonzero(stream == 0) + 1)[:-1]
    decoded = [tokenizer.decode(d[:-1].tolist()) for d in docs]
    assert decoded == text.documents(TEXT)  # byte-level: exact round trip, non-ASCII included
    src = tokens.TokenSource(out, seq_len=4, vocab_size=400)
    np.testing.assert_array_equal(src[0]["inputs"], stream[:4])


def test_vocab_checks_and_missing_files(tmp_path, pydoc_tokenizer):
    tokenizer, _ = pydoc_tokenizer
    text.check_vocab(tokenizer, 400)
    with pytest.raises(ValueError, match="the tokenizer has 400 tokens but model.vocab_size=399"):
        text.check_vocab(tokenizer, 399)
    with pytest.raises(ValueError, match="vocab_size=200 is below the 256 bytes"):
        text.train_tokenizer([tmp_path / "x.txt"], tmp_path / "tok", 200)
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        text.load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        text.tokenize_file(tmp_path / "nope.txt", tokenizer, tmp_path / "o.npy", eos_id=0)
    with pytest.raises(ValueError, match="eos_id=400 is not an id"):
        text.tokenize_file(tmp_path / "nope.txt", tokenizer, tmp_path / "o.npy", eos_id=400)


def test_missing_tokenizers_package_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "t.txt").write_text(TEXT)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        text.train_tokenizer([tmp_path / "t.txt"], tmp_path / "tok", 300)


def test_cli_trains_a_tokenizer(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(TEXT * 20)
    text.main([str(tmp_path / "t.txt"), str(tmp_path / "tok"), "--vocab-size", "300"])
    assert "tokenizer.json" in capsys.readouterr().out
    assert text.load_tokenizer(tmp_path / "tok").get_vocab_size() <= 300
