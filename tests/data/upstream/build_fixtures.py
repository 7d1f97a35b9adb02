"""Writes the upstream-shaped fixtures in this folder (run it to regenerate them; the output is committed).

Each folder mirrors one hub dataset that config/config.yaml names: the same file layout, the card's
`configs:` (so `datasets.load_dataset(folder, name, split=...)` resolves exactly as on the hub), the
real column names and types, and the quirks seen in the dataset viewers. Only the text is ours: a few
dozen rows, templated so they are distinct. README.md in each folder says which card it follows.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
TOPICS = [
    "a linked list",
    "a binary heap",
    "an LRU cache",
    "a trie",
    "a ring buffer",
    "a bloom filter",
    "a union-find structure",
    "an interval tree",
    "a rate limiter",
    "a CSV parser",
    "a JSON tokenizer",
    "a URL router",
    "a thread pool",
    "a priority queue",
    "a skip list",
    "a matrix multiply",
    "a topological sort",
    "Dijkstra's algorithm",
    "a sudoku checker",
    "a run-length encoder",
]
LANGS = ["Python", "Rust", "Go", "TypeScript"]


def uid(*parts: object) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(map(str, parts))))


def write_card(folder: Path, header: str, note: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(f"---\n{header.strip()}\n---\n{note.strip()}\n")


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


# -- nvidia/Nemotron-Post-Training-Dataset-v2 ------------------------------------------------------
NEMOTRON_SCHEMA = pa.schema(
    [
        ("uuid", pa.string()),
        ("license", pa.string()),
        ("generator", pa.string()),
        ("version", pa.string()),
        ("category", pa.string()),
        ("reasoning", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ]
)


def nemotron_row(split: str, i: int, turns: list[tuple[str, str]], reasoning: str) -> dict:
    # Every row opens with an empty system turn: the quirk that once dropped all of them.
    messages = [{"role": "system", "content": ""}] + [{"role": r, "content": c} for r, c in turns]
    return {
        "uuid": uid("nemotron", split, i),
        "license": "CC BY 4.0",
        "generator": "DeepSeek-R1-0528, Qwen3-235B-A22B",
        "version": "v2",
        "category": split,
        "reasoning": reasoning,
        "messages": messages,
    }


def think(answer: str, reasoning: str) -> str:
    return f"<think>\nLet me work through this.\n</think>\n\n{answer}" if reasoning == "on" else answer


def nemotron() -> None:
    folder = HERE / "nemotron-post-training-v2"
    write_card(
        folder,
        """
dataset_info:
  features:
  - {name: uuid, dtype: string}
  - {name: license, dtype: string}
  - {name: generator, dtype: string}
  - {name: version, dtype: string}
  - {name: category, dtype: string}
  - {name: reasoning, dtype: string}
  - name: messages
    list:
    - {name: role, dtype: string}
    - {name: content, dtype: string}
configs:
- config_name: default
  data_files:
  - {split: chat, path: data/chat-*}
  - {split: code, path: data/code-*}
  - {split: math, path: data/math-*}
""",
        """
Follows the card of nvidia/Nemotron-Post-Training-Dataset-v2: one `default` config whose splits are
categories (stem, chat, math, code, multilingual_*; stem and multilingual omitted here), columns
uuid/license/generator/version/category/reasoning/messages, `messages` a list of {role, content}
that starts with an empty system turn on every row, assistant answers with `<think>` blocks when
`reasoning` is "on", and multi-turn chat rows.
""",
    )
    code = []
    for i in range(40):
        topic, lang = TOPICS[i % len(TOPICS)], LANGS[i // len(TOPICS) % len(LANGS)]
        reasoning = "on" if i % 3 else "off"
        question = (
            f"Implement {topic} in {lang}. Explain the time and space complexity of each operation, "
            f"handle the edge cases (empty input, a single element, very large inputs) and include "
            f"a few unit tests. Variant {i}: keep the public API small and document it."
        )
        code.append(
            nemotron_row("code", i, [("user", question), ("assistant", think("```\n...\n```", reasoning))], reasoning)
        )
    chat = []
    for i in range(30):
        reasoning = "on" if i % 2 else "off"
        q = f"What are good ways to plan a {['week', 'month', 'trip', 'garden', 'study term'][i % 5]} (case {i})?"
        turns = [("user", q), ("assistant", think("Here are some ideas.", reasoning))]
        if i % 4 == 0:  # multi-turn rows: turns: first keeps the conversation up to the first answer
            turns += [("user", "Can you make that shorter?"), ("assistant", "Sure.")]
        chat.append(nemotron_row("chat", i, turns, reasoning))
    math = []
    for i in range(30):
        q = nemotron_math_question(i)
        math.append(nemotron_row("math", i, [("user", q), ("assistant", think("x = ...", "on"))], "on"))
    for split, rows in (("code", code), ("chat", chat), ("math", math)):
        write_parquet(folder / "data" / f"{split}-00000-of-00001.parquet", rows, NEMOTRON_SCHEMA)


SKIES = ["blue", "red at sunset", "white when cloudy"]


# -- BAAI/Infinity-Instruct, config 0625 ---------------------------------------------------------------
def infinity() -> None:
    folder = HERE / "infinity-instruct"
    write_card(
        folder,
        """
configs:
- config_name: '0625'
  data_files:
  - {split: train, path: 0625/*}
- config_name: 7M
  data_files:
  - {split: train, path: 7M/*}
""",
        """
Follows the card of BAAI/Infinity-Instruct (config 0625): columns id, conversations (sharegpt:
{from: human|gpt, value}), label (struct of ability lists), langdetect, source. Rows are English and
Chinese, some multi-turn. Config 7M is declared on the card but its files are not included here.
""",
    )
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
            (
                "label",
                pa.struct(
                    [
                        (k, pa.list_(pa.string()))
                        for k in ("ability_en", "ability_zh", "cate_ability_en", "cate_ability_zh")
                    ]
                ),
            ),
            ("langdetect", pa.string()),
            ("source", pa.string()),
        ]
    )
    rows = []
    for i in range(30):
        zh = i % 5 == 0
        q = (
            f"请解释一下第{i}个关于光合作用的问题。"
            if zh
            else f"Explain, for a curious teenager, why the sky looks {SKIES[i % 3]} (question {i})."
        )
        conv = [{"from": "human", "value": q}, {"from": "gpt", "value": "..."}]
        if i % 6 == 1:
            conv += [{"from": "human", "value": "Give one more example."}, {"from": "gpt", "value": "..."}]
        rows.append(
            {
                "id": str(1000 + i),
                "conversations": conv,
                "label": {
                    "ability_en": ["explanation"],
                    "ability_zh": ["解释"],
                    "cate_ability_en": ["natural science"],
                    "cate_ability_zh": ["自然科学"],
                },
                "langdetect": "zh-cn" if zh else "en",
                "source": "Subjective",
            }
        )
    write_parquet(folder / "0625" / "train-00000-of-00001.parquet", rows, schema)


# -- NousResearch/hermes-function-calling-v1 ----------------------------------------------------------
PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within <tools> </tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions.\n<tools>\n{tools}\n</tools>\nFor each function call return a json "
    "object with function name and arguments within <tool_call> </tool_call> tags with the following schema:\n"
    "<tool_call>\n{{'arguments': <args-dict>, 'name': <function-name>}}\n</tool_call>\n"
)


def tool(name: str, description: str, params: dict[str, str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
                "required": list(params),
            },
        },
    }


def hermes() -> None:
    folder = HERE / "hermes-function-calling-v1"
    write_card(
        folder,
        """
configs:
- config_name: func_calling_singleturn
  data_files: func-calling-singleturn.json
  default: true
- config_name: glaive_func_calling
  data_files: glaive-function-calling-5k.json
""",
        """
Follows the card and viewer of NousResearch/hermes-function-calling-v1: JSON arrays (not JSONL), one
file per config, columns id, conversations (sharegpt: from system|human|gpt|tool), category,
subcategory, task. The system prompt names `<tools> </tools>` in prose before the real block, and the
block is a Python literal (single quotes) in most rows and JSON in some. glaive_func_calling has
multi-turn rows with tool turns and rows whose system prompt has no tools at all. Configs func_calling,
json_mode_agentic and json_mode_singleturn are left out.
""",
    )
    single = []
    for i in range(12):
        tools = [
            tool(
                f"get_inventory_{i}",
                "Retrieves current inventory levels for each store.",
                {"api_endpoint": "The endpoint."},
            ),
            tool(
                f"update_order_{i}",
                "Updates the status of an order.",
                {"order_id": "The order.", "status": "New status."},
            ),
        ]
        block = json.dumps(tools) if i % 3 == 0 else repr(tools)
        single.append(
            {
                "id": uid("hermes", i),
                "conversations": [
                    {"from": "system", "value": PREAMBLE.format(tools=block)},
                    {
                        "from": "human",
                        "value": f"Our store {i} is running low; check the inventory and mark order A{i} shipped.",
                    },
                    {
                        "from": "gpt",
                        "value": "<tool_call>\n"
                        f"{{'arguments': {{'api_endpoint': '/inv'}}, 'name': 'get_inventory_{i}'}}\n</tool_call>",
                    },
                ],
                "category": "E-commerce Platforms",
                "subcategory": "Inventory Management",
                "task": f"Manage store inventory {i}",
            }
        )
    (folder / "func-calling-singleturn.json").write_text(json.dumps(single, indent=2, ensure_ascii=False))
    glaive = []
    for i in range(12):
        if i % 4 == 3:  # glaive rows without tools keep their system prompt
            conv = [
                {"from": "system", "value": "You are a helpful assistant, with no access to external functions."},
                {"from": "human", "value": f"Can you suggest a name for a bakery on street {i}?"},
                {"from": "gpt", "value": "How about ...?"},
            ]
        else:
            tools = [
                tool(
                    f"convert_currency_{i}",
                    "Convert an amount between currencies.",
                    {"amount": "Amount.", "to": "Target currency."},
                )
            ]
            conv = [
                {"from": "system", "value": PREAMBLE.format(tools=repr(tools))},
                {"from": "human", "value": f"Hi, I need to convert {100 + i} US dollars to euros."},
                {
                    "from": "gpt",
                    "value": "<tool_call>\n"
                    f"{{'name': 'convert_currency_{i}', 'arguments': {{'amount': {100 + i}, 'to': 'EUR'}}}}\n"
                    "</tool_call>",
                },
                {"from": "tool", "value": "<tool_response>\n{'converted_amount': 85.0}\n</tool_response>"},
                {"from": "gpt", "value": "That is about 85 euros."},
            ]
        glaive.append({"id": uid("glaive", i), "conversations": conv, "category": "", "subcategory": "", "task": ""})
    (folder / "glaive-function-calling-5k.json").write_text(json.dumps(glaive, indent=2, ensure_ascii=False))


# -- sahil2801/CodeAlpaca-20k --------------------------------------------------------------------------
def code_alpaca() -> None:
    folder = HERE / "code-alpaca-20k"
    write_card(
        folder,
        "license: cc-by-4.0",
        """
Follows sahil2801/CodeAlpaca-20k: one JSON array `code_alpaca_20k.json` with instruction, input
(often the empty string) and output; no `configs:` on the card, so the one split is `train`.
""",
    )
    rows = []
    for i in range(40):
        topic = TOPICS[i % len(TOPICS)]
        rows.append(
            {
                "instruction": f"Write a function that builds {topic} from a list of numbers (task {i}).",
                "input": "" if i % 2 else f"[{i}, {i + 1}, {i + 2}]",
                "output": "def build(xs):\n    ...",
            }
        )
    (folder / "code_alpaca_20k.json").write_text(json.dumps(rows, indent=4))


# -- bigcode/self-oss-instruct-sc2-exec-filter-50k -----------------------------------------------------
def self_oss() -> None:
    folder = HERE / "self-oss-instruct-sc2-exec-filter-50k"
    write_card(
        folder,
        """
configs:
- config_name: default
  data_files:
  - {split: train, path: data/train-*}
""",
        """
Follows bigcode/self-oss-instruct-sc2-exec-filter-50k: parquet under data/, columns fingerprint
(null), sha1, seed (the code snippet), response, concepts, prompt (the generation prompt that
produced the instruction: not what to answer), instruction, id. Hence `fields: {prompt: instruction}`.
""",
    )
    schema = pa.schema(
        [
            ("fingerprint", pa.null()),
            ("sha1", pa.string()),
            ("seed", pa.string()),
            ("response", pa.string()),
            ("concepts", pa.list_(pa.string())),
            ("prompt", pa.string()),
            ("instruction", pa.string()),
            ("id", pa.int64()),
        ]
    )
    rows = []
    for i in range(20):
        rows.append(
            {
                "fingerprint": None,
                "sha1": uid("sha1", i).replace("-", "")[:40],
                "seed": f"def f{i}(x):\n    return x * {i}\n",
                "response": "## Reasoning\n...",
                "concepts": ["list comprehension", "type checking"],
                "prompt": "Provide the best response to a given instruction. Follow these steps: ...",
                "instruction": (
                    f"Write a Python function `scale_{i}` that multiplies every element of a list by {i} and "
                    "raises a `TypeError` with a clear message when an element is not a number. Include doctests."
                ),
                "id": 4000 + i,
            }
        )
    write_parquet(folder / "data" / "train-00000-of-00001.parquet", rows, schema)


# -- openai/gsm8k (a math set in `prompt` format) -------------------------------------------------------
def gsm8k() -> None:
    folder = HERE / "gsm8k"
    write_card(
        folder,
        """
configs:
- config_name: main
  data_files:
  - {split: train, path: main/train-*}
  - {split: test, path: main/test-*}
""",
        """
Follows openai/gsm8k (config main): parquet with `question` and `answer` (worked solution ending in
`#### N`). Read with format `prompt` and `fields: {prompt: question}`. The test split stands in for the
benchmark in the production rehearsal's `decontaminate` (its text is ours): one of its questions is a
prompt of the Nemotron math fixture, as real training sets hold benchmark questions.
""",
    )
    schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
    rows = [
        {
            "question": f"Natalia sold clips to {10 + 2 * i} of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May?",
            "answer": f"In May she sold {5 + i} clips.\n#### {(10 + 2 * i) * 3 // 2}",
        }
        for i in range(10)
    ]
    write_parquet(folder / "main" / "train-00000-of-00001.parquet", rows, schema)
    test = [
        {
            "question": f"A baker makes {12 + i} loaves each morning and sells {i + 3} of them before noon. How many "
            "loaves are left for the afternoon customers, and how many does he sell in a week?",
            "answer": f"#### {9}",
        }
        for i in range(7)
    ]
    test.append({"question": nemotron_math_question(7), "answer": "#### 5"})
    write_parquet(folder / "main" / "test-00000-of-00001.parquet", test, schema)


def nemotron_math_question(i: int) -> str:
    return f"Solve for x: {i + 2}x + {3 * i + 1} = {5 * i + 40}. Give the exact value and check it."


# -- the other benchmarks DFlash reports (stand-ins for the rehearsal's decontaminate: layout, not text) -
def benchmarks() -> None:
    folder = HERE / "math-500"
    write_card(
        folder,
        "configs:\n- config_name: default\n  data_files:\n  - {split: test, path: test.jsonl}",
        "Follows HuggingFaceH4/MATH-500: one test.jsonl with problem/solution/answer/subject/level/unique_id.",
    )
    with open(folder / "test.jsonl", "w") as f:
        for i in range(5):
            row = {
                "problem": f"Find the number of ordered pairs $(a, b)$ of positive integers with $a + b = {20 + i}$ "
                "such that both $a$ and $b$ are prime.",
                "solution": "...",
                "answer": str(i),
                "subject": "Number Theory",
                "level": 3,
                "unique_id": f"test/number_theory/{100 + i}.json",
            }
            f.write(json.dumps(row) + "\n")
    folder = HERE / "openai-humaneval"
    write_card(
        folder,
        "configs:\n- config_name: openai_humaneval\n  data_files:\n  - {split: test, path: openai_humaneval/test-*}",
        "Follows openai/openai_humaneval: task_id, prompt (a signature and docstring), canonical_solution, "
        "test, entry_point.",
    )
    schema = pa.schema([(c, pa.string()) for c in ("task_id", "prompt", "canonical_solution", "test", "entry_point")])
    rows = [
        {
            "task_id": f"HumanEval/{i}",
            "prompt": f'def count_runs_{i}(values: list) -> int:\n    """Return how many maximal runs of equal '
            'neighbouring values the list holds, counting an empty list as having none at all."""\n',
            "canonical_solution": "    ...\n",
            "test": "def check(candidate):\n    pass\n",
            "entry_point": f"count_runs_{i}",
        }
        for i in range(5)
    ]
    write_parquet(folder / "openai_humaneval" / "test-00000-of-00001.parquet", rows, schema)
    folder = HERE / "mbpp"
    write_card(
        folder,
        "configs:\n- config_name: sanitized\n  data_files:\n  - {split: test, path: sanitized/test-*}",
        "Follows google-research-datasets/mbpp (config sanitized): source_file, task_id, prompt, code, "
        "test_imports, test_list.",
    )
    schema = pa.schema(
        [("source_file", pa.string()), ("task_id", pa.int32()), ("prompt", pa.string()), ("code", pa.string()),
         ("test_imports", pa.list_(pa.string())), ("test_list", pa.list_(pa.string()))]
    )  # fmt: skip
    rows = [
        {
            "source_file": "Benchmark Questions Verification V2.ipynb",
            "task_id": 600 + i,
            "prompt": f"Write a python function to find the sum of the {i + 2} largest distinct numbers in a given "
            "list of integers, returning zero when there are fewer of them.",
            "code": "def f(xs):\n    ...",
            "test_imports": [],
            "test_list": ["assert True"],
        }
        for i in range(5)
    ]
    write_parquet(folder / "sanitized" / "test-00000-of-00001.parquet", rows, schema)
    folder = HERE / "mt-bench-prompts"
    write_card(
        folder,
        "configs:\n- config_name: default\n  data_files:\n  - {split: train, path: data/train-*}",
        "Follows HuggingFaceH4/mt_bench_prompts: prompt (a list: the two turns), prompt_id, category, reference.",
    )
    schema = pa.schema(
        [("prompt", pa.list_(pa.string())), ("prompt_id", pa.int64()), ("category", pa.string()),
         ("reference", pa.list_(pa.string()))]
    )  # fmt: skip
    rows = [
        {
            "prompt": [
                f"Draft a professional email to a colleague about moving the quarterly planning meeting to week {i} "
                "and ask which afternoon suits the whole team best.",
                "Now rewrite it as a limerick that keeps every detail of the original message.",
            ],
            "prompt_id": 81 + i,
            "category": "writing",
            "reference": [],
        }
        for i in range(5)
    ]
    write_parquet(folder / "data" / "train-00000-of-00001.parquet", rows, schema)


# -- nebius/SWE-rebench-openhands-trajectories ----------------------------------------------------------
OPENHANDS_SYSTEM = (
    "You are OpenHands agent, a helpful AI assistant that can interact with a computer to solve tasks.\n"
    "<ROLE>Your primary role is to assist users by executing commands, modifying code, and solving technical "
    "problems effectively.</ROLE>"
)
OPENHANDS_TOOLS = [
    {
        "function": {
            "description": "Execute a bash command in the terminal within a persistent shell session.",
            "name": "execute_bash",
            "parameters": {
                "properties": {
                    "command": {"description": "The bash command to execute.", "type": "string"},
                    "is_input": {"description": "If True, the command is an input to the running process.",
                                 "enum": ["true", "false"], "type": "string"},
                },
                "required": ["command"],
                "type": "object",
            },
        },
        "type": "function",
    },
    {
        "function": {
            "description": "Custom editing tool for viewing, creating and editing files.",
            "name": "str_replace_editor",
            "parameters": {
                "properties": {
                    "command": {"description": "The command to run.",
                                "enum": ["view", "create", "str_replace"], "type": "string"},
                    "path": {"description": "Absolute path to file or directory.", "type": "string"},
                    "old_str": {"description": "The string in `path` to replace.", "type": "string"},
                    "new_str": {"description": "The new string.", "type": "string"},
                },
                "required": ["command", "path"],
                "type": "object",
            },
        },
        "type": "function",
    },
    {
        "function": {
            "description": "Signals the completion of the current task or conversation.",
            "name": "finish",
            "parameters": {
                "properties": {"message": {"description": "Final message to send to the user.", "type": "string"}},
                "required": ["message"],
                "type": "object",
            },
        },
        "type": "function",
    },
]  # fmt: skip


def openhands_call(i: int, k: int, name: str, arguments: dict) -> dict:
    call = {"arguments": json.dumps(arguments), "name": name}
    return {"function": call, "id": f"toolu_{uid('openhands', i, k)[:8]}", "type": "function"}


def openhands_trajectory(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    module = topic.split()[-1].replace("'", "")
    path = f"/workspace/repo__{i}/src/{module}.py"
    steps = [
        (
            "I'll start by exploring the repository structure.",
            "str_replace_editor",
            {"command": "view", "path": path},
            f"Here's the result of running `cat -n` on {path}:\n     1\tdef run():\n     2\t    return None",
        ),
        (
            "Let me reproduce the issue first.",
            "execute_bash",
            {"command": f"cd /workspace/repo__{i} && python -m pytest -q"},
            "F.\n1 failed, 1 passed in 0.12s\n[The command completed with exit code 1.]",
        ),
        (
            "",
            "str_replace_editor",
            {"command": "str_replace", "path": path, "old_str": "    return None", "new_str": "    return 42"},
            f"The file {path} has been edited.",
        ),
    ]
    messages = [
        {"content": OPENHANDS_SYSTEM, "name": None, "role": "system", "tool_call_id": None, "tool_calls": None},
        {
            "content": f"<uploaded_files>\n/workspace/repo__{i}\n</uploaded_files>\nI've uploaded a python code "
            f"repository. Consider the following issue: `run()` in {topic} returns None instead of 42.",
            "name": None,
            "role": "user",
            "tool_call_id": None,
            "tool_calls": None,
        },
    ]
    for k, (thought, name, arguments, observation) in enumerate(steps[: 1 + i % 3]):
        call = openhands_call(i, k, name, arguments)
        messages.append(
            {"content": thought, "name": None, "role": "assistant", "tool_call_id": None, "tool_calls": [call]}
        )
        messages.append(
            {"content": observation, "name": name, "role": "tool", "tool_call_id": call["id"], "tool_calls": None}
        )
    finish = openhands_call(i, 9, "finish", {"message": "The issue is fixed."})
    messages.append({"content": "", "name": None, "role": "assistant", "tool_call_id": None, "tool_calls": [finish]})
    return messages


def swe_rebench_openhands() -> None:
    folder = HERE / "swe-rebench-openhands-trajectories"
    write_card(
        folder,
        """
license: cc-by-4.0
tags:
- code
- synthetic
- tools
- agents
- software
size_categories:
- 10K<n<100K
""",
        """
Follows the card and viewer of nebius/SWE-rebench-openhands-trajectories (67,074 trajectories of
Qwen3-Coder-480B-A35B-Instruct in OpenHands v0.54.0; CC-BY-4.0): one file at the repository's root,
trajectories.parquet, and no `configs:` in the card, so `datasets` reads it as the train split. Columns
trajectory_id, instance_id, repo, trajectory (messages: content, name, role system|user|assistant|tool,
tool_call_id, tool_calls with `function.arguments` as a JSON string, as the card's "How to use" decodes
it), tools (OpenHands' tool schemas), model_patch, exit_status, resolved, gen_tests_correct,
pred_passes_gen_tests. The viewer shows `tools` as a list of objects; stored as Arrow structs (a table
written from Python dicts), each tool's `parameters.properties` holds every tool's property names, null
where that tool has none. That is inferred, not seen in the viewer, and this fixture reproduces it.
Trajectories here have 2-4 calls and end on `finish`; the real ones average about 60 turns.
""",
    )
    rows = [
        {
            "trajectory_id": f"chatcmpl-{uid('openhands', i).replace('-', '')}",
            "instance_id": f"owner__repo{i}-{100 + i}",
            "repo": f"owner/repo{i}",
            "trajectory": openhands_trajectory(i),
            "tools": OPENHANDS_TOOLS,
            "model_patch": f"diff --git a/src/x{i}.py b/src/x{i}.py\n-    return None\n+    return 42\n",
            "exit_status": "submit",
            "resolved": i % 2,
            "gen_tests_correct": None if i % 3 else 1.0,
            "pred_passes_gen_tests": None if i % 3 else 1.0,
        }
        for i in range(12)
    ]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "trajectories.parquet")  # Arrow infers the structs


if __name__ == "__main__":
    nemotron()
    infinity()
    hermes()
    code_alpaca()
    self_oss()
    gsm8k()
    benchmarks()
    swe_rebench_openhands()
