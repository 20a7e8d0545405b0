"""CLIP's byte-level BPE tokenizer, OpenAI's rewritten here: `tokenize` matches `clip.tokenize(..., truncate=True)`;
and what the models read off token ids: where captions end, and what each position of a caption predicts.

    from tokenizer import tokenize
    tokenize(["the red cube moved"], context_length=32)  # [1, 32]: SOT, BPE ids, EOT, zero padding
"""
import functools
import gzip
import hashlib
import html
from pathlib import Path

import ftfy
import regex as re
import torch

BPE_PATH = Path(__file__).parent / "assets" / "bpe_simple_vocab_16e6.txt.gz"
BPE_SHA256 = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"
N_MERGES = 49152 - 256 - 2  # vocab 49408 = 256 bytes * 2 (+ '</w>' forms) + merges + SOT + EOT
SOT, EOT = 49406, 49407  # the start- and end-of-text ids
SPECIAL = ("<|startoftext|>", "<|endoftext|>")
TOKEN_PATTERN = re.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    re.IGNORECASE)


def bytes_to_unicode():
    """Map every byte to a printable unicode character, so BPE never sees whitespace or control codes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # moved past 255, in order
    return dict(zip(printable + others, map(chr, printable + list(range(256, 256 + len(others))))))


def clean(text):
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip().lower()


class Tokenizer:
    def __init__(self, bpe_path=BPE_PATH):
        raw = Path(bpe_path).read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != BPE_SHA256:
            raise ValueError(f"{bpe_path}: SHA-256 {digest} is not that of OpenAI's merges file ({BPE_SHA256})")
        lines = gzip.decompress(raw).decode("utf-8").split("\n")
        merges = [tuple(line.split()) for line in lines[1:N_MERGES + 1]]  # line 0 is a version header
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        vocab = list(self.byte_encoder.values())
        vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + list(SPECIAL)
        self.encoder = {tok: i for i, tok in enumerate(vocab)}
        self.decoder = {i: tok for tok, i in self.encoder.items()}
        self.bpe_ranks = {m: i for i, m in enumerate(merges)}

    @functools.lru_cache(maxsize=100_000)
    def bpe(self, word):
        """Merge the symbols of one word, lowest-ranked pair first, until no known pair is left."""
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            pairs = {(a, b) for a, b in zip(symbols, symbols[1:])}
            best = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i < len(symbols) - 1 and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return tuple(symbols)

    def encode(self, text):
        ids = []
        for word in TOKEN_PATTERN.findall(clean(text)):
            if word in SPECIAL:
                ids.append(self.encoder[word])
                continue
            word = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids.extend(self.encoder[s] for s in self.bpe(word))
        return ids

    def decode(self, ids):
        text = "".join(self.decoder[i] for i in ids if i not in (SOT, EOT))
        text = bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
        return text.replace("</w>", " ").strip()


@functools.lru_cache(maxsize=1)
def get_tokenizer():
    return Tokenizer()


def tokenize(texts, context_length=77):
    """SOT + BPE ids + EOT, zero padded to `context_length`; overlong texts are cut and still end in EOT."""
    if isinstance(texts, str):
        texts = [texts]
    if not (isinstance(texts, (list, tuple)) and all(isinstance(t, str) for t in texts)):
        raise TypeError(f"tokenize takes a string or a list of strings, not {texts!r:.80}")
    return to_tensor([get_tokenizer().encode(text) for text in texts], context_length)


def to_tensor(encoded, context_length):
    """Lists of BPE ids -> [N, context_length]: SOT + ids + EOT, zero padded, cut as tokenize cuts."""
    out = torch.zeros(len(encoded), context_length, dtype=torch.long)
    for row, ids in enumerate(encoded):
        ids = ([SOT] + ids)[:context_length - 1] + [EOT]  # clip's truncate=True: [EOT] alone at length 1
        out[row, :len(ids)] = torch.tensor(ids)
    return out


# ---- Token ids as the models read them: where captions end, what each position predicts ------
def skip_padding(x):
    """Whether to leave out the padding after EOT, at the cost of shapes read off the data. Eager code on the CPU saves
    time so, and the host sync costs nothing; a GPU would stall at the sync, and compiled code would recompile."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def trim_padding(tokens):
    return tokens[:, :int((tokens == EOT).int().argmax(dim=1).max()) + 1] if skip_padding(tokens) else tokens


IGNORE = -100  # target id of the padding after a caption's EOT: no loss


def next_tokens(tokens):
    """What each position of tokenized captions [N, L] predicts: the next id, up to EOT; IGNORE after it."""
    return tokens[:, 1:].masked_fill(torch.cumsum(tokens == EOT, dim=1)[:, :-1] > 0, IGNORE)
