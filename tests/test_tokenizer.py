"""tokenizer.py's BPE tokenizer gives OpenAI's ids, on a deterministic corpus of awkward strings."""
import gzip
import random

import pytest
import torch

import tokenizer
from openai_reference import simple_tokenizer

WORDS = ["a", "photo", "of", "the", "cat", "dog", "Red", "CUBE", "sphere", "cylinder", "moved", "changed",
         "colour", "metal", "rubber", "is", "there", "no", "change", "TheRe", "isN'T", "McDonald", "iPhone",
         "supercalifragilisticexpialidocious", "antidisestablishmentarianism", "x", "Q", "ok"]
ACCENTS = ["café", "naïve", "résumé", "Ünïcödé", "straße", "ÅNGSTRÖM", "façade", "piñata", "Zoë", "élève",
           "crème brûlée", "Œuvre", "ﬁnal", "Ⅻ", "ｆｕｌｌｗｉｄｔｈ", "e\u0301", "mañana", "Ελληνικά", "русский"]
CJK = ["猫", "写真", "赤い立方体", "日本語のテキスト", "한국어", "中文字符测试", "ひらがな", "カタカナ", "一二三"]
EMOJI = ["😀", "🐱", "👍🏽", "🇫🇷", "👨‍👩‍👧", "❤️", "🔴🟢🔵", "✨", "🤖"]
ENTITIES = ["&amp;", "&lt;b&gt;", "&quot;", "&#39;", "&nbsp;", "&amp;amp;", "&eacute;", "&#x1F431;", "&copy;", "&bogus;"]
DIGITS = ["0", "42", "3.14159", "1,000,000", "2022", "007", "1e-5", "v2.0", "10x", "½", "٣", "१२"]
PUNCT = [".", ",", "!!!", "?!", "...", "---", "(", ")", "[]", "{}", "@#$%^&*", "''", '"', "`", "~~", "<|", "|>",
         "/\\", "::", ";", "…", "—", "«»", "¡¿"]
SPACES = [" ", "  ", "\t", "\n", " \n\t ", "\u00a0", "\u3000", "\r\n", "\u2003"]
CONTRACTIONS = ["it's", "don't", "they're", "we've", "I'm", "you'll", "he'd", "IT'S", "Don'T", "o'clock",
                "rock'n'roll", "'tis", "dogs'"]
SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|ENDOFTEXT|>"]
POOLS = [WORDS, WORDS, WORDS, ACCENTS, CJK, EMOJI, ENTITIES, DIGITS, PUNCT, CONTRACTIONS, SPECIAL]
FIXED = ["", " ", "\n\n", "a photo of a cat.", "A PHOTO OF A CAT.", "the red cube has moved",
         "word " * 200, "猫" * 120, "😀" * 60, "!" * 300, "a" * 500, "&amp;" * 40, "x y " * 100]


def corpus(n=2000, seed=0):
    rng = random.Random(seed)
    texts = list(FIXED)
    while len(texts) < n:
        parts = [rng.choice(rng.choice(POOLS)) for _ in range(rng.randint(1, 12))]
        parts = [p.upper() if rng.random() < 0.1 else p for p in parts]
        seps = [rng.choice(SPACES) if rng.random() < 0.8 else "" for _ in parts]
        text = "".join(p + s for p, s in zip(parts, seps))
        texts.append(text * rng.choice([1, 1, 1, 2, 30]))  # some texts are longer than the context
    return texts


@pytest.fixture(scope="module")
def reference():
    return simple_tokenizer.SimpleTokenizer()


def reference_tokenize(tok, texts, context_length=77):
    """clip.tokenize(texts, truncate=True), written out (its module cannot be imported here)."""
    out = torch.zeros(len(texts), context_length, dtype=torch.long)
    for row, text in enumerate(texts):
        ids = [tok.encoder["<|startoftext|>"]] + tok.encode(text) + [tok.encoder["<|endoftext|>"]]
        if len(ids) > context_length:
            ids = ids[:context_length]
            ids[-1] = tok.encoder["<|endoftext|>"]
        out[row, :len(ids)] = torch.tensor(ids)
    return out


def test_special_tokens_match_reference(reference):
    assert tokenizer.SOT == reference.encoder["<|startoftext|>"]
    assert tokenizer.EOT == reference.encoder["<|endoftext|>"]
    assert tokenizer.get_tokenizer().encoder == reference.encoder


def test_known_vector():
    ids = tokenizer.tokenize("a photo of a cat.")
    assert ids.shape == (1, 77)
    assert ids[0, :8].tolist() == [49406, 320, 1125, 539, 320, 2368, 269, 49407]
    assert not ids[0, 8:].any()


def test_corpus_matches_reference(reference):
    texts = corpus()
    assert len(texts) >= 2000
    ours = tokenizer.get_tokenizer()
    bad = [t for t in texts if ours.encode(t) != reference.encode(t)]
    assert not bad, f"{len(bad)} strings tokenized differently, e.g. {bad[:5]!r}"
    expected = reference_tokenize(reference, texts)
    got = tokenizer.tokenize(texts)
    assert (got[:, -1] != 0).any(), "the corpus should contain texts longer than the context"
    bad = [texts[i] for i in (got != expected).any(dim=1).nonzero().flatten().tolist()]
    assert not bad, f"{len(bad)} strings differ after SOT/EOT/truncation, e.g. {bad[:5]!r}"


def test_truncation_keeps_eot():
    ids = tokenizer.tokenize(["word " * 200], context_length=77)[0]
    assert ids[0] == tokenizer.SOT and ids[-1] == tokenizer.EOT and (ids != 0).all()


def test_short_context_lengths_match_reference(reference):
    texts = ["", "a", "a photo", "a photo of a cat"]
    for context_length in range(1, 7):  # at 1, clip.tokenize keeps only the EOT that replaced SOT
        expected = reference_tokenize(reference, texts, context_length)
        assert torch.equal(tokenizer.tokenize(texts, context_length), expected), context_length


def test_decode_matches_reference(reference):
    ours = tokenizer.get_tokenizer()
    for text in corpus(500, seed=1):
        ids = ours.encode(text)
        if tokenizer.SOT in ids or tokenizer.EOT in ids:
            continue  # our decode drops the special tokens, the reference's spells them out
        assert ours.decode(ids) == reference.decode(ids).strip(), text


def test_decode_round_trips_plain_text():
    tok = tokenizer.get_tokenizer()
    rng = random.Random(2)
    for _ in range(200):
        text = " ".join(rng.choice(WORDS + CJK + ACCENTS[:10]).lower() for _ in range(rng.randint(1, 10)))
        if "'" in text:  # contractions split off as their own token and decode with a space before them
            continue
        assert tok.decode(tok.encode(text)) == text


def test_corrupted_merges_file_is_rejected(tmp_path):
    lines = gzip.decompress(tokenizer.BPE_PATH.read_bytes()).decode("utf-8").split("\n")
    lines[100], lines[101] = lines[101], lines[100]  # two merges swapped: the ranks silently change
    bad = tmp_path / "bpe.txt.gz"
    bad.write_bytes(gzip.compress("\n".join(lines).encode("utf-8")))
    with pytest.raises(ValueError, match="SHA-256"):
        tokenizer.Tokenizer(bad)
