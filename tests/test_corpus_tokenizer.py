import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from moespec.training.corpus import (
    STDLIB_SKIP_DIRS, CorpusSpec, cut_windows, load_corpus, tokenize_stream,
)
from moespec.training.tokenizer import SPECIAL_TOKENS, train_tokenizer

PROJECT_TOKENIZER = Path(__file__).resolve().parents[1] / "checkpoints" / "tokenizer"

TRICKY_TEXTS = [
    "def f(x):\n    if x:\n\treturn  x  \n\n\n    # trailing   \n",
    "naïve café — 日本語 🚀 Ωμέγα\r\nline two\u00a0nbsp",
    "  leading spaces and a lone \\ backslash\t\t",
    "spaces before punctuation , . ! ? do n't 's",
]


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    train_tokenizer(load_corpus(CorpusSpec(max_bytes=200_000)), vocab_size=300, out_dir=out)
    return out


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def test_stdlib_split_is_deterministic_and_disjoint():
    first, second = load_corpus(), load_corpus()
    assert first.train == second.train and first.heldout == second.heldout
    train_keys = {doc.key for doc in first.train}
    heldout_keys = {doc.key for doc in first.heldout}
    assert train_keys and heldout_keys and not train_keys & heldout_keys
    assert len(train_keys) == len(first.train)  # one document per file
    assert not any(STDLIB_SKIP_DIRS & set(key.split("/")[:-1]) for key in train_keys | heldout_keys)


def test_max_bytes_takes_a_prefix_of_each_split():
    full = load_corpus()
    capped = load_corpus(CorpusSpec(max_bytes=50_000))
    assert capped.train == full.train[:len(capped.train)]
    assert capped.heldout == full.heldout[:len(capped.heldout)]
    assert sum(doc.num_bytes for doc in capped.train[:-1]) < 50_000


def test_user_corpus_of_txt_dir_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("alpha text")
    docs = tmp_path / "docs" / "sub"
    docs.mkdir(parents=True)
    (docs / "b.md").write_text("# bravo")
    (docs / "ignored.bin").write_bytes(b"\xff\xfe")
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"body": "charlie"}) + "\n\n" + json.dumps({"body": "delta ü"}) + "\n")
    spec = CorpusSpec(source=[str(tmp_path / "a.txt"), str(tmp_path / "docs"), str(tmp_path / "c.jsonl")],
                      heldout_fraction=0.0, jsonl_field="body")
    corpus = load_corpus(spec)
    assert list(corpus.train_texts()) == ["alpha text", "# bravo", "charlie", "delta ü"]
    assert list(corpus.heldout_texts()) == []


def test_user_corpus_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1.*'text'"):
        load_corpus(CorpusSpec(source=[str(bad)]))
    with pytest.raises(FileNotFoundError, match="missing"):
        load_corpus(CorpusSpec(source=[str(tmp_path / "missing")]))
    with pytest.raises(ValueError, match="'stdlib' or a list of paths"):
        CorpusSpec(source="stdlb")


def test_tiny_tokenizer_round_trips_exactly(tiny_tokenizer):
    for text in TRICKY_TEXTS:
        ids = tiny_tokenizer.encode(text)
        assert tiny_tokenizer.decode(ids) == text


def test_special_token_ids_and_no_automatic_bos(tiny_tokenizer):
    assert len(tiny_tokenizer) == 300
    assert tiny_tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(7))
    assert SPECIAL_TOKENS[:3] == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id) == (0, 1, 2)
    assert tiny_tokenizer.encode("x = 1") == tiny_tokenizer.encode("x = 1", add_special_tokens=False)
    assert tiny_tokenizer.encode("<|user|>hi<|end|>")[0] == 4


def test_chat_template_renders_roles(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    closed = tiny_tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert closed == "<|user|>\nHi<|end|>\n"
    with pytest.raises(Exception, match="allowed: system, user, assistant, tool"):
        tiny_tokenizer.apply_chat_template([{"role": "developer", "content": "x"}], tokenize=False)


def test_project_tokenizer_loads_and_round_trips_heldout_file():
    tokenizer = AutoTokenizer.from_pretrained(PROJECT_TOKENIZER)
    assert len(tokenizer) == 4096
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(7))
    heldout = next(load_corpus(CorpusSpec(max_bytes=1)).heldout_texts())
    ids = tokenizer.backend_tokenizer.encode(heldout, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == heldout
    assert len(heldout.encode()) / len(ids) > 2.5  # a trained vocabulary, not raw bytes


def test_stream_separates_documents_and_windows_are_reproducible(tiny_tokenizer):
    stream = tokenize_stream(TRICKY_TEXTS * 20, tiny_tokenizer)
    assert stream.dtype == np.int32 and (stream == 1).sum() == 80 and stream[-1] == 1
    first, again, other = (cut_windows(stream, 17, seed) for seed in (3, 3, 4))
    assert first.shape[1] == 17 and len(stream) // 17 - 1 <= first.shape[0] <= len(stream) // 17
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
