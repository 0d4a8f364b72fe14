import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moespec.detokenizer import IncrementalDetokenizer, StopChecker

WORDS = ["héllo", "wörld", "✓", "日本語", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
         "naïve", "café", "STOP", "end", "token", "stream", "über", "straße", "ça", "va", "Ωmega", "42", "\n"]
# Characters the tokenizer never saw: they stay split into single-byte tokens.
UNSEEN = "漢字 🙂 ñ€"


@pytest.fixture(scope="module")
def tokenizer():
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(300)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|eos|>")


def one_shot(tokenizer, ids, skip_special_tokens=True):
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, prompt_ids, ids, chunk=1, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [detok.append(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, pieces


# --- IncrementalDetokenizer -----------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_one_shot_decode_for_random_streams(tokenizer, chunk, skip_special_tokens):
    rng = random.Random(chunk)
    ascii_end = encode(tokenizer, "a")  # ends any incomplete UTF-8 sequence so nothing stays held
    for _ in range(50):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 8))]
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))] + ascii_end
        detok, pieces = stream(tokenizer, prompt, ids, chunk, skip_special_tokens)
        expected = one_shot(tokenizer, ids, skip_special_tokens)
        assert "".join(pieces) == detok.text == expected


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = encode(tokenizer, "the fox") + [tokenizer.eos_token_id] + encode(tokenizer, " end")
    assert stream(tokenizer, [], ids)[0].text == "the fox end"
    assert stream(tokenizer, [], ids, skip_special_tokens=False)[0].text == "the fox<|eos|> end"


def test_split_multibyte_characters_never_leak_replacement_chars(tokenizer):
    text = f"héllo {UNSEEN} wörld ✓ 日本語 {UNSEEN}"
    ids = encode(tokenizer, text)
    assert any("\ufffd" in one_shot(tokenizer, [i]) for i in ids), "the text should split characters"
    prompt = encode(tokenizer, "naïve café 漢")
    detok, pieces = stream(tokenizer, prompt, ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert detok.text == text
    assert "" in pieces  # some tokens had to wait for the rest of their character


def test_prompt_context_keeps_the_leading_space_of_metaspace_tokens():
    # SentencePiece-style decoding drops the space of a text's first "▁word"; after a
    # prompt that space belongs to the output.
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    bpe.train_from_iterator(["hello world the fox"] * 10, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    metaspace = PreTrainedTokenizerFast(tokenizer_object=bpe)
    ids = encode(metaspace, "hello world the fox")
    detok, _ = stream(metaspace, ids[:1], ids[1:])
    assert one_shot(metaspace, ids[1:]) == "world the fox"
    assert detok.text == " world the fox"


def test_no_tokenizer_gives_empty_text():
    detok = IncrementalDetokenizer(None, [1, 2, 3])
    assert detok.append([4, 5]) == "" and detok.text == ""


# --- StopChecker on plain strings ---------------------------------------------------------------

def feed(checker, chunks):
    """Feeds growing text; returns (final check, the streamed text, every streamed prefix)."""
    text, streamed, prefixes, result = "", 0, [], None
    for chunk in chunks:
        text += chunk
        result = checker.check(text)
        assert result.stream_len >= streamed, "streamed text can't be taken back"
        streamed = result.stream_len
        prefixes.append(result.text[:streamed])
        if result.stopped:
            break
    return result, result.text[:streamed], prefixes


def test_stop_string_split_across_many_appends():
    result, streamed, _ = feed(StopChecker(("STOP",), False), ["abc S", "T", "O", "Pxyz"])
    assert result.stopped and result.text == "abc " and streamed == "abc "


def test_earliest_stop_string_wins():
    result, _, _ = feed(StopChecker(("world", "lo w"), False), ["hel", "lo world"])
    assert result.text == "hel"
    result, _, _ = feed(StopChecker(("world", "lo w"), True), ["hello world"])
    assert result.text == "hello w"


def test_holdback_releases_text_that_does_not_become_a_stop_string():
    checker = StopChecker(("</end>",), False)
    assert checker.check("a </e").stream_len == 2
    assert checker.check("a </ex").stream_len == 6
    assert not checker.check("a </ex").stopped


def test_no_stop_strings_streams_everything():
    result = StopChecker(None, False).check("anything")
    assert not result.stopped and result.stream_len == 8 and result.text == "anything"


def test_only_the_tail_is_searched():
    checker = StopChecker(("ab",), False)
    checker.checked_len = 10  # pretend text[:10] was searched: a match wholly inside it is not looked for
    assert not checker.check("ab" + "x" * 10).stopped


# --- StopChecker with the detokenizer -------------------------------------------------------

def generate(tokenizer, text, stop, include=False):
    """Streams `text` token by token through the detokenizer and stop checker."""
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "the fox"))
    checker = StopChecker(stop, include)
    streamed, result = "", None
    for token in encode(tokenizer, text):
        detok.append([token])
        result = checker.check(detok.text)
        streamed += result.text[len(streamed):result.stream_len]
        assert result.text.startswith(streamed), "streamed text must be a prefix of the final text"
        if result.stopped:
            break
    return result, streamed


def token_texts(tokenizer, text):
    return [one_shot(tokenizer, [i]) for i in encode(tokenizer, text)]


def test_stop_inside_one_token(tokenizer):
    text = "the quick brown fox jumps"
    pieces = token_texts(tokenizer, text)
    long_piece = max(pieces, key=len)
    assert len(long_piece) >= 4
    stop = long_piece[1:-1]
    result, streamed = generate(tokenizer, text, (stop,))
    cut = text.index(stop)
    assert result.stopped and result.text == streamed == text[:cut]


def test_stop_spanning_two_tokens(tokenizer):
    text = "héllo wörld over the lazy dog"
    pieces = token_texts(tokenizer, text)
    i = next(i for i in range(len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    result, streamed = generate(tokenizer, text, (stop,))
    assert result.stopped and result.text == streamed == text[:text.index(stop)]
    assert stop not in streamed


def test_stop_at_the_start(tokenizer):
    result, streamed = generate(tokenizer, "café naïve end", ("caf",))
    assert result.stopped and result.text == "" and streamed == ""


def test_stop_prefix_is_held_back_until_the_stop_completes(tokenizer):
    text = "the dog jumps over STOP the fox"
    result, streamed = generate(tokenizer, text, ("over STOP",))
    assert result.stopped and result.text == streamed == "the dog jumps "
    # Every partial stop string stays unstreamed while it is incomplete; generate() checks
    # each step's streamed text is a prefix of the final one, which a leaked "over ST" is not.


def test_include_stop_str_in_output(tokenizer):
    text = "the quick brown fox jumps over the lazy dog"
    result, streamed = generate(tokenizer, text, ("fox",), include=True)
    assert result.stopped and result.text == streamed == "the quick brown fox"


def test_text_without_stop_is_streamed_up_to_the_holdback(tokenizer):
    result, streamed = generate(tokenizer, "the lazy dog STO", ("STOP",))
    assert not result.stopped and result.text == "the lazy dog STO" and streamed == "the lazy dog "
