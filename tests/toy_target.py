"""A toy target model whose greedy answers are learnable, category-specific text: a tiny Qwen3
(Qwen3ForCausalLM) trained here, on CPU, on its own ChatML chats, for the tests that need a target whose
drafter can learn something ("the data buys acceptance").

Two categories of prompts, each answered by a fixed template, a deterministic function of the prompt:

- ``math``: "What is 7 plus 5?" / "Add 7 and 5." / "Find the sum of 7 and 5." ... (five phrasings each of
  plus and minus of 1..9, with positive results, and times of 1..5) ->
  "We add 7 and 5. 7 plus 5 is 12. So the answer is 12."
- ``prose``: "Describe the old river." / "Tell me about the old river." / "Write about the old river." (14
  adjectives, 12 nouns) -> three sentences built from the adjective's and the noun's own phrases ("The old
  river is quiet and grey. People walk along the old river in the morning. Everyone likes the river, and
  the river is always old.").

The two share no words but "the", "is", "and", "from". Held-out prompts (``prompts(..., held_out=True)``:
142 math, 102 prose) are never trained on: math holds out one of the five phrasings of each fact (the fact
is trained in the other four); prose holds out a fifth of its (adjective, noun) pairs (each adjective and
noun trained with others). The training prompts (``held_out=False``: 568 math, 402 prose) are what the
target saw; it answers them as exactly (seed 0: 564/568 and 402/402 greedy; held out 138/142 and 102/102),
so a build may draw from either. It knows single-turn chats in its own template only (no system turn, at
most about 64 tokens: later positions were never trained; a long multi-turn chat gets garbage).

``python -m tests.toy_target [OUT [SEED]]`` builds the model folder (config, weights, generation config,
tokenizer with its chat template, toy_target.json: how it was made) at OUT, by default tests/data/toy_target/,
the committed copy the tests use (seed 0, torch 2.13 CPU, 67 s on 2 cores): a clean clone needs no build,
and another torch may train other weights, which the tests would then not have pinned.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CATEGORIES = ("math", "prose")
WEIGHTS = (3, 2)  # the categories' shares of the training batches: math's facts take longer to learn
COMMITTED = Path(__file__).resolve().parent / "data" / "toy_target"

EOS, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, MASK]  # ids 0..3, in this order
VOCAB_SIZE = 512
MIN_EXACT = 0.95  # the share of held-out prompts of each category a build must answer exactly
# ChatML as Qwen's (no thinking, no default system turn); add_generation_prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention takes 32 (not 16)
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}

# ---------------------------------------------------------------------------------------------------------
# The categories: every prompt of a category, its answer, and whether it is held out.

_OPS: dict[str, tuple[Callable[[int, int], int], range, list[str], str]] = {
    "plus": (
        lambda a, b: a + b,
        range(1, 10),
        [
            "What is {a} plus {b}?",
            "Add {a} and {b}.",
            "Compute {a} + {b}.",
            "How much is {a} plus {b}?",
            "Find the sum of {a} and {b}.",
        ],
        "We add {a} and {b}. {a} plus {b} is {c}. So the answer is {c}.",
    ),
    "minus": (
        lambda a, b: a - b,
        range(1, 10),
        [
            "What is {a} minus {b}?",
            "Subtract {b} from {a}.",
            "Compute {a} - {b}.",
            "How much is {a} minus {b}?",
            "Take {b} away from {a}.",
        ],
        "We take {b} from {a}. {a} minus {b} is {c}. So the answer is {c}.",
    ),
    "times": (
        lambda a, b: a * b,
        range(1, 6),
        [
            "What is {a} times {b}?",
            "Multiply {a} by {b}.",
            "Compute {a} * {b}.",
            "How much is {a} times {b}?",
            "Find the product of {a} and {b}.",
        ],
        "We multiply {a} by {b}. {a} times {b} is {c}. So the answer is {c}.",
    ),
}
# each adjective: how the thing is; each noun: what people do with it, and when
_ADJECTIVES = {
    "old": "quiet and grey",
    "small": "easy to miss",
    "bright": "full of light",
    "dark": "cold and still",
    "green": "soft and calm",
    "busy": "loud and warm",
    "hidden": "hard to find",
    "tall": "seen from far away",
    "empty": "silent all day",
    "sunny": "warm in the afternoon",
    "ancient": "older than anyone remembers",
    "narrow": "only a few steps wide",
    "famous": "known in every town",
    "windy": "cool and fresh",
}
_NOUNS = {
    "river": ("walk along", "in the morning"),
    "garden": ("sit in", "after lunch"),
    "market": ("shop at", "on weekends"),
    "bridge": ("cross", "every evening"),
    "forest": ("hike through", "in the summer"),
    "village": ("live in", "all year"),
    "library": ("read in", "on rainy days"),
    "station": ("wait at", "before work"),
    "harbor": ("fish in", "at dawn"),
    "castle": ("visit", "during holidays"),
    "beach": ("swim at", "in July"),
    "museum": ("walk around", "on Sundays"),
}
_PROSE_PROMPTS = ["Describe the {adj} {noun}.", "Tell me about the {adj} {noun}.", "Write about the {adj} {noun}."]
_PROSE_ANSWER = (
    "The {adj} {noun} is {how}. People {do} the {adj} {noun} {when}. "
    "Everyone likes the {noun}, and the {noun} is always {adj}."
)


def _math_items() -> list[tuple[str, str, bool]]:
    items = []
    for o, (op, numbers, phrasings, answer) in enumerate(_OPS.values()):
        for a in numbers:
            for b in numbers:
                if op(a, b) <= 0:
                    continue
                for p, phrasing in enumerate(phrasings):
                    held = (a * 7 + b * 3 + p + o) % 5 == 0  # one of the five phrasings of each fact
                    items.append((phrasing.format(a=a, b=b), answer.format(a=a, b=b, c=op(a, b)), held))
    return items


def _prose_items() -> list[tuple[str, str, bool]]:
    items = []
    for i, (adj, how) in enumerate(_ADJECTIVES.items()):
        for j, (noun, (do, when)) in enumerate(_NOUNS.items()):
            held = (i * 3 + j) % 5 == 0  # a fifth of the pairs: every adjective and noun trained with others
            text = _PROSE_ANSWER.format(adj=adj, noun=noun, how=how, do=do, when=when)
            items += [(phrasing.format(adj=adj, noun=noun), text, held) for phrasing in _PROSE_PROMPTS]
    return items


ITEMS: dict[str, list[tuple[str, str, bool]]] = {"math": _math_items(), "prose": _prose_items()}
ANSWERS: dict[str, str] = {prompt: answer for items in ITEMS.values() for prompt, answer, _ in items}


def prompts(category: str, n: int, seed: int, held_out: bool = False) -> list[str]:
    """``n`` distinct user prompts of ``category``, drawn by ``seed``: held out from the target's training,
    or among those it trained on."""
    pool = [prompt for prompt, _, held in ITEMS[category] if held is held_out]
    if n > len(pool):
        raise ValueError(f"{category}: {n} prompts asked, {len(pool)} there (held_out={held_out})")
    return random.Random(f"{category}-{seed}").sample(pool, n)


def answer(prompt: str) -> str:
    """The template's answer to one of :func:`prompts`'s prompts."""
    return ANSWERS[prompt]


def category_of(prompt: str) -> str:
    return next(c for c, items in ITEMS.items() if any(p == prompt for p, _, _ in items))


# ---------------------------------------------------------------------------------------------------------
# The build: tokenizer, model, training.


def train_tokenizer() -> Any:
    """A byte-level BPE of VOCAB_SIZE ids over the rendered chats; digits one token each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [f"user\n{p}\nassistant\n{a}\n" for items in ITEMS.values() for p, a, _ in items]
    tok.train_from_iterator(texts, trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    return tok


def _render_prompt(prompt: str) -> str:
    return f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"  # CHAT_TEMPLATE's, checked in build


def _write_tokenizer(tok: Any, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOS,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": SHAPE["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": IM_END, "pad_token": EOS, "additional_special_tokens": [IM_START, IM_END, MASK]})
        + "\n"
    )


def _encode(tok: Any, items: list[tuple[str, str, bool]]) -> list[tuple[list[int], int]]:
    """Each chat's ids (the rendered prompt, then the answer and <|im_end|>) and where its answer starts."""
    end = tok.token_to_id(IM_END)
    out = []
    for prompt, text, _ in items:
        head = tok.encode(_render_prompt(prompt)).ids
        out.append((head + tok.encode(text).ids + [end], len(head)))
    return out


def _batch(chats: list[tuple[list[int], int]], pad: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in chats)
    ids = torch.full((len(chats), width), pad, dtype=torch.long)
    mask = torch.zeros((len(chats), width), dtype=torch.long)
    labels = torch.full((len(chats), width), -100, dtype=torch.long)
    for row, (chat, start) in enumerate(chats):
        ids[row, : len(chat)] = torch.tensor(chat)
        mask[row, : len(chat)] = 1
        labels[row, start : len(chat)] = torch.tensor(chat[start:])
    return ids, mask, labels


def _exact(model: Any, chats: list[tuple[list[int], int]], pad: int) -> float:
    """The share of chats whose every answer token (and the stop) is the model's argmax given the ones
    before: exactly the chats greedy decoding answers with the template."""
    import torch

    right = 0
    with torch.no_grad():
        for i in range(0, len(chats), 128):
            ids, mask, labels = _batch(chats[i : i + 128], pad)
            guess = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
            wanted = labels[:, 1:]
            right += int(((guess == wanted) | (wanted == -100)).all(-1).sum())
    return right / len(chats)


def train(
    tok: Any, seed: int, steps: int = 400, batch_size: int = 48, lr: float = 6e-3, log: Callable[[str], None] = print
) -> tuple[Any, dict[str, float]]:
    """The model, trained on the training chats (loss on the answers, the categories in turn) for ``steps``
    steps of a warmed-up, cosine-decayed learning rate; it stops early once every held-out chat is exact.
    Also the share of held-out chats of each category it answers exactly."""
    import math

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    pad, end = tok.token_to_id(EOS), tok.token_to_id(IM_END)
    config = Qwen3Config(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=None,
        eos_token_id=end,
        pad_token_id=pad,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        **SHAPE,
    )
    model = Qwen3ForCausalLM(config)
    training = {c: _encode(tok, [i for i in ITEMS[c] if not i[2]]) for c in CATEGORIES}
    held = {c: _encode(tok, [i for i in ITEMS[c] if i[2]]) for c in CATEGORIES}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 10)
    rng = random.Random(seed)
    start = time.monotonic()
    for step in range(1, steps + 1):
        progress = max(0.0, (step - warmup) / max(1, steps - warmup))
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        model.train()
        chats = [rng.choice(training[rng.choices(CATEGORIES, WEIGHTS)[0]]) for _ in range(batch_size)]
        ids, mask, labels = _batch(chats, pad)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps:
            model.eval()
            exact = {c: round(_exact(model, held[c], pad), 4) for c in CATEGORIES}
            log(f"step {step}: loss {loss.item():.4f}, held-out chats exact {exact}, {time.monotonic() - start:.0f}s")
            if min(exact.values()) == 1.0:
                break
    return model, exact


def build(out: Path, seed: int = 0, log: Callable[[str], None] = print) -> Path:
    """The toy target's model folder at ``out`` (written beside it, then renamed into place): config.json,
    model.safetensors, generation_config.json, the tokenizer (tokenizer.json, tokenizer_config.json with the
    chat template) and toy_target.json (how it was made, and how exact it came out). Refuses a model that
    answers fewer than MIN_EXACT of the held-out prompts of a category exactly."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    started = time.monotonic()
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = train_tokenizer()
    _write_tokenizer(tok, tmp)
    hf_tok = AutoTokenizer.from_pretrained(tmp)
    rendered = hf_tok.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == _render_prompt("x"), rendered
    with torch.random.fork_rng():
        model, exact = train(tok, seed, log=log)
    if min(exact.values()) < MIN_EXACT:
        shutil.rmtree(tmp)
        raise RuntimeError(f"the toy target answers too few held-out prompts exactly: {exact}")
    model.save_pretrained(tmp)
    generation = {"eos_token_id": [tok.token_to_id(IM_END), tok.token_to_id(EOS)], "pad_token_id": 0,
                  "do_sample": False}  # fmt: skip
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    made = {
        "made_by": "tests/toy_target.py",
        "seed": seed,
        "held_out_exact": exact,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.monotonic() - started, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (tmp / "toy_target.json").write_text(json.dumps(made, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def greedy_answers(model_dir: Path, asked: list[str], max_new_tokens: int = 64) -> list[str]:
    """The model's greedy answers (transformers' generate, prompts through the chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok.padding_side = "left"
    chats = [[{"role": "user", "content": p}] for p in asked]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens)
    return [tok.decode(row[batch["input_ids"].shape[1] :], skip_special_tokens=True) for row in out]


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else COMMITTED
    seed = int(argv[1]) if len(argv) > 1 else 0
    start = time.monotonic()
    build(out, seed)
    print(f"built {out} in {time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
