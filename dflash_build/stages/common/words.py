"""Normalised words and word n-grams of many texts at once, as stable 64-bit hashes.

Near-duplicate removal and decontamination compare prompts by their words, so both read them here,
the same way: Unicode NFC, lower case, and a word is a run of letters, digits and other characters that
are not punctuation, symbols or spaces (so "Janet’s ducks," is ``janet s ducks``, as "Janet's" is).
Scripts written without spaces between words (Han, Hiragana, Katakana, Thai, Lao, Khmer, Myanmar,
Tibetan) have no such runs: there every character is a word of its own, so "我们今天学习。" is seven
words, and scripts mix inside one text ("用Python写" is ``用 python 写``). An n-gram then counts
characters there: one Chinese character carries about as much as one English word (some 10 bits by
their corpora's entropy, ~1.5 characters a Chinese word), so decontamination's 13-gram is 13 characters
and near-duplicate shingles are character runs, with the thresholds unchanged.
The hashes are pure functions of the words' UTF-8 bytes (no per-process salt), so every run, machine
and job agrees. Vectorised over a batch: a few passes of numpy over the bytes, no Python per word.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_build import hashing

_SPLITMIX_GAMMA = np.uint64(hashing.SPLITMIX_GAMMA)
_NGRAM_MULTIPLIER = np.uint64(0x100000001B3)
_WORD_BYTE = np.zeros(256, dtype=bool)
_WORD_BYTE[[*range(ord("0"), ord("9") + 1), *range(ord("a"), ord("z") + 1), *range(ord("A"), ord("Z") + 1)]] = True
_WORD_BYTE[0x80:] = True  # every byte of a non-ASCII character
_HIGH_BITS = np.uint64(0x8080808080808080)
# Code points of scripts written without spaces between words, as [first, last + 1) bounds: Thai, Lao,
# Tibetan, Myanmar, Khmer (and its symbols), CJK radicals, 々〆〇, Hiragana, Katakana, Bopomofo, Katakana
# extensions, CJK Extension A, CJK Unified Ideographs, CJK compatibility ideographs, halfwidth Katakana,
# the Kana supplements, and CJK Extensions B to H. Each such character is a word of its own.
SPACELESS = np.array(
    [
        *(0x0E00, 0x10A0, 0x1780, 0x1800, 0x19E0, 0x1A00, 0x2E80, 0x2FE0, 0x3005, 0x3008, 0x3040, 0x3130),
        *(0x31F0, 0x3200, 0x3400, 0x4DC0, 0x4E00, 0xA000, 0xF900, 0xFB00, 0xFF66, 0xFFA0, 0x1B000, 0x1B170),
        *(0x20000, 0x40000),
    ],
    dtype=np.int64,
)
_CASE_BITS = np.uint64(0x2020202020202020)


class Words:
    """The words of a batch of texts: a hash per word, and where each text's words start."""

    def __init__(self, hashes: np.ndarray, offsets: np.ndarray) -> None:
        self.hashes = hashes  # uint64, the words of every text one after another
        self.offsets = offsets  # int64, len(texts) + 1: text i's words are hashes[offsets[i]:offsets[i + 1]]
        counts = np.diff(offsets)
        self._counts = counts
        self._text_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        # words from each one to its text's end, itself included
        self._left = offsets[1:][self._text_of] - np.arange(len(hashes), dtype=np.int64)
        self._prefix: np.ndarray | None = None

    def ngrams(self, n: int, whole_if_shorter: bool) -> tuple[np.ndarray, np.ndarray]:
        """(hash of every run of ``n`` consecutive words within one text, each run's text index).

        ``whole_if_shorter``: a text of fewer than ``n`` words (but one at least) gives one hash, of all
        its words, so a short prompt still has a set to compare; otherwise it gives none. A run's hash
        is the polynomial sum of its words' hashes (times M to the power of their distance from its
        end, mod 2^64) through prefix sums, so it costs the same for any ``n``."""
        total = len(self.hashes)
        is_start = self._left >= n
        if whole_if_shorter:
            short = np.flatnonzero((self._counts < n) & (self._counts > 0))
            is_start[self.offsets[short]] = True
        starts = np.flatnonzero(is_start)
        ends = starts + np.minimum(self._left[starts], n)
        power, inverse = _powers(total + 1)
        if self._prefix is None:
            self._prefix = np.zeros(total + 1, dtype=np.uint64)
            with np.errstate(over="ignore"):
                np.cumsum(self.hashes * inverse[:total], out=self._prefix[1:])
        with np.errstate(over="ignore"):
            combined = (self._prefix[ends] - self._prefix[starts]) * power[ends - 1]
            combined ^= (ends - starts).astype(np.uint64) * _SPLITMIX_GAMMA
        return hashing.splitmix64(combined), self._text_of[starts]


_POWERS: list[np.ndarray] = [np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)]


def _powers(count: int) -> tuple[np.ndarray, np.ndarray]:
    """M^k and M^-k mod 2^64 for k < count (M is odd, so it has an inverse), kept between calls."""
    if len(_POWERS[0]) < count:
        size = max(count, 2 * len(_POWERS[0]))
        inverse = np.uint64(pow(int(_NGRAM_MULTIPLIER), -1, 1 << 64))
        with np.errstate(over="ignore"):
            for i, step in enumerate((_NGRAM_MULTIPLIER, inverse)):
                values = np.full(size, step, dtype=np.uint64)
                values[0] = 1
                _POWERS[i] = np.cumprod(values, dtype=np.uint64)
    return _POWERS[0], _POWERS[1]


def words(texts: pa.Array | pa.ChunkedArray) -> Words:
    """The normalised words of each text (null: none)."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    texts, ascii_only = _unicode_folded(texts.cast(pa.large_string()).fill_null(""))
    offsets = np.frombuffer(texts.buffers()[1], dtype=np.int64)[texts.offset : texts.offset + len(texts) + 1]
    first, last = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
    data = texts.buffers()[2]
    raw = np.frombuffer(data, dtype=np.uint8)[first:last] if data is not None else np.zeros(0, dtype=np.uint8)
    offsets = offsets - first
    edges = np.diff(_WORD_BYTE[raw].view(np.int8), prepend=np.int8(0), append=np.int8(0))
    is_start, is_end = edges == 1, edges == -1
    # a word would run on from one text into the next, or from one character of a script without spaces
    # into the next, where both sides of the boundary are word bytes: cut it there
    cuts = offsets[1:-1] if ascii_only else np.concatenate([offsets[1:-1], _spaceless_edges(raw)])
    cuts = cuts[(cuts > 0) & (cuts < len(raw))]
    cuts = cuts[_WORD_BYTE[raw[cuts - 1]] & _WORD_BYTE[raw[cuts]]]
    is_start[cuts] = is_end[cuts] = True
    starts, ends = np.flatnonzero(is_start), np.flatnonzero(is_end)
    hashes = _hash_spans(raw, starts, ends)
    return Words(hashes, np.searchsorted(starts, offsets).astype(np.int64))


def _spaceless_edges(raw: np.ndarray) -> np.ndarray:
    """Where each character of a script without spaces (:data:`SPACELESS`) starts and ends, in UTF-8 bytes:
    every such character is three or four bytes long, so only lead bytes 0xE0 and up are decoded."""
    out = []
    leads = np.flatnonzero(raw >= 0xE0)
    for length, lead in ((3, 0xE0), (4, 0xF0)):
        at = leads[(raw[leads] >= lead) & (raw[leads] < lead + (0x10 if length == 3 else 0x08))]
        at = at[at + length <= len(raw)]
        code = (raw[at] & (0x0F if length == 3 else 0x07)).astype(np.int64)
        for k in range(1, length):
            code = (code << 6) | (raw[at + k] & 0x3F)
        inside = np.searchsorted(SPACELESS, code, side="right") % 2 == 1
        out += [at[inside], at[inside] + length]
    return np.concatenate(out)


def _unicode_folded(texts: pa.Array) -> tuple[pa.Array, bool]:
    """The texts with those that are not ASCII in NFC, lower case, and their punctuation and symbols
    (curly quotes, dashes, ellipses) as spaces, so they separate words as ASCII punctuation does, and
    whether all are ASCII. ASCII texts are left as they are: their letters are lowered as their words
    are hashed."""
    ascii_rows = pc.string_is_ascii(texts)
    if not len(texts) or pc.all(ascii_rows).as_py():
        return texts, True
    other = np.flatnonzero(~ascii_rows.to_numpy(zero_copy_only=False))
    folded = pc.utf8_lower(pc.utf8_normalize(texts.take(pa.array(other)), "NFC"))
    folded = pc.replace_substring_regex(folded, r"[\p{P}\p{S}\p{Z}]", " ")
    order = np.arange(len(texts), dtype=np.int64)
    order[other] = len(texts) + np.arange(len(other), dtype=np.int64)
    return pa.concat_arrays([texts, folded]).take(pa.array(order)), False


def _lowered(word: np.ndarray) -> np.ndarray:
    """Eight bytes of words, ASCII letters lowered: a word's ASCII bytes are letters and digits, and
    setting bit 5 lowers a letter and leaves a digit as it is; bytes of non-ASCII characters (high bit
    set, lowered by Arrow already) are left alone."""
    non_ascii = ((word & _HIGH_BITS) >> np.uint64(7)) * np.uint64(0xFF)
    return word | (_CASE_BITS & ~non_ascii)


def _hash_spans(raw: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each span's bytes: eight bytes at a time, read as little-endian words."""
    padded = np.empty((len(raw) + 23) // 8 * 8, dtype=np.uint8)
    padded[: len(raw)] = raw
    padded[len(raw) :] = 0
    # a 64-bit word at every byte position (a strided view, no copy)
    at_byte = np.lib.stride_tricks.as_strided(padded.view(np.uint64), shape=(len(raw) + 8,), strides=(1,))
    lengths = (ends - starts).astype(np.int64)
    with np.errstate(over="ignore"):
        first = np.minimum(lengths, 8).astype(np.uint64)
        drop = (np.uint64(8) - first) * np.uint64(8)
        hashes = (lengths.astype(np.uint64) * _SPLITMIX_GAMMA) ^ ((_lowered(at_byte[starts]) << drop) >> drop)
    todo = np.flatnonzero(lengths > 8)
    chunk = 1
    while len(todo):
        left = np.minimum(lengths[todo] - 8 * chunk, 8).astype(np.uint64)
        drop = (np.uint64(8) - left) * np.uint64(8)
        word = _lowered(at_byte[starts[todo] + 8 * chunk])
        word = (word << drop) >> drop  # only this span's bytes (little-endian: the low ones)
        with np.errstate(over="ignore"):
            hashes[todo] = hashes[todo] * _NGRAM_MULTIPLIER + word
        chunk += 1
        todo = todo[lengths[todo] > 8 * chunk]
    return hashing.splitmix64(hashes)
