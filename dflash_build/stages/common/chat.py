"""The target model's tokenizer and chat template: how every prompt is rendered into token ids.

Generation sends token ids, never text, so the ids the model saw are exactly the ids the training
sample holds.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash_build import gguf_meta
from dflash_build.spec import ModelSpec
from dflash_build.store import atomic

log = logging.getLogger(__name__)

_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "dflash_probe_tool",
            "description": "probe",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
]


class TemplateError(ValueError):
    pass


def answer_slots(messages: list[dict[str, Any]], turns: str) -> list[int]:
    """Where each answer of a prompt's conversation goes (the message index it takes). ``first``: one
    answer after the whole prompt; ``all``: each assistant turn, and one after a conversation that does
    not end with one."""
    if turns == "first":
        return [len(messages)]
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not messages or messages[-1]["role"] != "assistant":
        slots.append(len(messages))
    return slots


def load_tokenizer(model: ModelSpec, cache_file: Path | None = None) -> Any:
    """The model's tokenizer with the configured chat template.

    ``cache_file`` (the plan's :meth:`~dflash_build.plan.Plan.tokenizer_cache`, keyed by the tokenizer's
    files, the template and the library versions) holds this tokenizer pickled: it loads in under a
    second, where ``AutoTokenizer`` imports torch through the model's config (about 5 s a job on CPU).
    It is only a cache, in the user's cache folder (never the store): one that does not load is replaced,
    one that cannot be written is skipped.
    """
    if cache_file is not None and cache_file.exists():
        try:
            with open(cache_file, "rb") as f:
                return pickle.load(f)
        except Exception as e:  # any damage, or a class the installed library no longer has
            log.warning("tokenizer cache %s does not load (%s): loading the tokenizer again", cache_file, e)
    tokenizer = _load_tokenizer(model)
    if cache_file is not None:
        try:
            with atomic.atomic_open(cache_file, "wb") as f:
                pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
        except OSError as e:  # a read-only or full disk: the next job loads it the slow way again
            log.info("tokenizer cache %s not written: %s", cache_file, e)
    return tokenizer


def _load_tokenizer(model: ModelSpec) -> Any:
    from transformers import AutoTokenizer

    path = model.tokenizer or model.path
    if path.endswith(".gguf"):
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=model.revision)
    if model.chat_template is not None:
        with open(model.chat_template, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if not tokenizer.chat_template:
        raise TemplateError(
            f"config key 'model.chat_template': the tokenizer at '{path}' has no chat template; give one"
        )
    return tokenizer


def stop_token_ids(tokenizer: Any, model_path: str) -> list[int]:
    """End-of-answer ids: the tokenizer's eos plus the model's generation_config eos ids."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_config = os.path.join(model_path, "generation_config.json")
    if os.path.isdir(model_path) and os.path.exists(gen_config):
        import json

        with open(gen_config, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise TemplateError(f"model '{model_path}': no eos token in its tokenizer or generation_config.json")
    return ids


def context_length(model: ModelSpec) -> int | None:
    """The context window: config, else the model's own config; None when neither says."""
    if model.context_length is not None:
        return model.context_length
    if model.path.endswith(".gguf"):
        return gguf_meta.context_length(model.path)
    config_file = os.path.join(model.path, "config.json")
    if not os.path.exists(config_file):
        return None
    import json

    with open(config_file, encoding="utf-8") as f:
        raw = json.load(f)
    for section in (raw, raw.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            if isinstance(section.get(key), int):
                return int(section[key])
    return None


def render_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: Mapping[str, Any],
    generation_prompt: bool = True,
) -> str:
    """The chat template's text for ``messages``, ending with the assistant header by default."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False, **dict(template_kwargs)
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    # The template already wrote any BOS; the tokenizer must not add another.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: Mapping[str, Any],
) -> list[int]:
    """Prompt token ids exactly as the target sees them, ending with the assistant header."""
    return encode(tokenizer, render_text(tokenizer, messages, tools, template_kwargs))


def check_renders_tools(tokenizer: Any, template_kwargs: Mapping[str, Any]) -> None:
    """Refuse a template that silently ignores tool schemas: tool rows would lose their tools."""
    probe = [{"role": "user", "content": "hi"}]
    plain = render_text(tokenizer, probe, None, template_kwargs)
    with_tools = render_text(tokenizer, probe, _PROBE_TOOLS, template_kwargs)
    if plain == with_tools:
        raise TemplateError(
            "config key 'model.chat_template': this source has rows with tools, but the chat template "
            "ignores `tools`; give a template that renders them"
        )
