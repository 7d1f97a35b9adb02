"""The automodel trainer (dflash_build/trainers/automodel_run.py, run by .venv-automodel's interpreter): NeMo
Automodel 0.7.0's own DFlash recipe trains a drafter on CPU from token rows, and vLLM 0.32.0's CPU server serves
what it publishes as a dflash drafter of the target it was trained for, which then drafts what the target says;
its EAGLE-3 recipe trains a head on the toy target's own chats that is published as vLLM's Llama EAGLE-3 head.

The unit tests (no marker): each bad input stops the runner in one line before anything trains, and the CPU
patches check the release and the code they change.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_build.trainers import automodel
from tests import toy_target
from tests.conftest import REPO, build_dflash_drafter, once_per_session, served_url, write_jsonl
from tests.test_vllm_drafter import _drafted

RUNNER = REPO / "dflash_build" / "trainers" / "automodel_run.py"
VOCAB = 512
SPECIAL = ["<pad>", "<s>", "</s>", "<mask>"]
MASK = 3  # <mask>: no row holds it
CYCLE = list(range(100, 116))  # the answers: this cycle of 16 tokens, from a random phase, which the target says
SETTINGS = {
    "recipe_args": {
        "mask_token_id": MASK,
        "micro_batch_size": 4,
        "block_size": 4,
        "draft_num_hidden_layers": 1,
        "target_layer_ids": [1, 2],  # build_dflash_drafter's for a 4-layer target
        "num_anchors": 16,
    },
    "optimizer": {"lr": 3e-3},
}
DRAFT = 3  # tokens drafted per step when served (block_size - 1)
# the toy target has 4 layers: Automodel's default aux layers [1, L/2-1, L-4] need 8 or more
EAGLE3_SETTINGS = {
    "recipe_args": {"ttt_steps": 3, "aux_layer_ids": [0, 1, 2], "micro_batch_size": 4},
    "optimizer": {"lr": 3e-3},
}


def build_target(out: Path, seed: int = 0) -> Path:
    """A 4-layer Qwen3 (hidden 128, 2 heads of 64: vLLM's CPU attention takes 64) over a 512-token word-level
    tokenizer, whose greedy answer walks :data:`CYCLE` once it reaches it: each cycle token's successor's
    output row is that token's embedding, and the embeddings (std 1) outweigh the random layers (std 0.02)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL + [f"w{i}" for i in range(len(SPECIAL), VOCAB)])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.normal_(0.0, 1.0)
        for token, successor in zip(CYCLE, CYCLE[1:] + CYCLE[:1], strict=True):
            head[successor] = embed[token]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def synthetic_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows: <s>, 8-16 random prompt tokens, then 24-48 tokens of the cycle and </s> (the answer)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(len(SPECIAL), VOCAB) for _ in range(rng.randint(8, 16))]
        phase = rng.randrange(len(CYCLE))
        answer = [CYCLE[(phase + k) % len(CYCLE)] for k in range(rng.randint(24, 48))] + [2]
        ids = [1, *prompt, *answer]
        rows.append({"id": i, "input_ids": ids, "loss_mask": [0] * (1 + len(prompt)) + [1] * len(answer)})
    return rows


def write_rows(folder: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Half the rows in a parquet file, half in a JSONL file (both readers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    half = len(rows) // 2
    pq.write_table(pa.Table.from_pylist(rows[:half]), folder / "rows-0.parquet")
    return [folder / "rows-0.parquet", write_jsonl(folder / "rows-1.jsonl", rows[half:])]


def write_run(path: Path, target: Path, rows: list[Path], **changes: Any) -> Path:
    run = {
        "recipe": "dflash",
        "target": str(target),
        "rows": [str(p) for p in rows],
        "out": str(path.parent / "drafter"),
        "work": str(path.parent / "work"),
        "settings": SETTINGS,
        **changes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1))
    return path


def run_trainer(python: Path, run: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The runner on one thread, as the suite's engines run (two pytest workers share two cores): on two, the
    tiny drafter's 75 steps took 14-45 s here beside other work, on one 1.5 s, to the same weights."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(python), str(RUNNER), str(run)], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
    )


def logged_losses(stdout: str) -> list[tuple[int, int, float]]:
    """``(step, steps, loss)`` of each ``automodel: step N/M loss L ...`` line."""
    found = []
    for line in stdout.splitlines():
        if line.startswith("automodel: step "):
            words = line.split()
            step, steps = words[2].split("/")
            found.append((int(step), int(steps), float(words[4])))
    return found


def _train(root: Path, python: Path) -> None:
    target = build_target(root / "target")
    rows = write_rows(root / "rows", synthetic_rows(300))
    run = write_run(root / "run" / "RUN.json", target, rows)
    started = time.monotonic()
    proc = run_trainer(python, run)
    seconds = time.monotonic() - started
    (root / "result.json").write_text(
        json.dumps({"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "seconds": seconds})
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, automodel_python: Path) -> dict[str, Any]:
    """The tiny target, and the drafter the runner trained for it on 300 rows (once per test run)."""
    root = once_per_session(tmp_path_factory, "automodel-trainer", lambda root: _train(root, automodel_python))
    result = json.loads((root / "result.json").read_text())
    assert result["rc"] == 0, result["stdout"][-3000:] + result["stderr"][-3000:]
    return {**result, "target": root / "target", "out": root / "run" / "drafter", "run": root / "run"}


@pytest.mark.workflow
def test_automodels_recipe_trains_a_drafter_whose_loss_falls(trained: dict[str, Any], tmp_path: Path) -> None:
    from safetensors import safe_open

    losses = logged_losses(trained["stdout"])
    record = json.loads((trained["out"] / "train.json").read_text())
    print(
        f"automodel trainer: {trained['seconds']:.1f} s in all, {record['train_seconds']} s training "
        f"{record['steps']} steps; loss {losses[0][2]} -> {losses[-1][2]}"
    )
    assert [s for s, _, _ in losses] == list(range(1, 76)), "300 rows in batches of 4: 75 steps, each logged"
    assert {m for _, m, _ in losses} == {75}
    assert losses[-1][2] < losses[0][2] - 1.0, losses
    assert (
        record["steps"] == 75
        and record["final_loss"] == pytest.approx(losses[-1][2], abs=1e-4)
        and record["automodel"] == "0.7.0"
    )
    assert record["rows"] == 300 and record["skipped_micro_batches"] == 0
    assert "epoch=0 step=75 loss=" in trained["stderr"], "Automodel's own log lines pass through"
    assert sorted(p.name for p in trained["run"].iterdir()) == ["RUN.json", "drafter", "work"], "no partial left"

    config = json.loads((trained["out"] / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["mask_token_id"] == MASK and config["dflash_config"]["target_layer_ids"] == [1, 2]
    assert config["block_size"] == 4 and config["num_hidden_layers"] == 1 and config["is_causal"] is False
    assert config["tie_word_embeddings"] is False

    reference = build_dflash_drafter(tmp_path / "reference", trained["target"], seed=0)
    shapes = {}
    for folder in (trained["out"], reference):
        shapes[folder] = {}
        for file in folder.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                shapes[folder] |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes[trained["out"]] == shapes[reference], "the layout of z-lab's drafters (conftest's fixture)"


@pytest.mark.workflow
def test_vllm_serves_the_trained_drafter_and_it_drafts_what_the_target_says(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    """vLLM's CPU server loads the published folder as the target's dflash drafter and answers greedily; the
    target walks the cycle, and the drafter, trained on rows of it, drafts it: most drafts are accepted (a
    random drafter's almost none: 16 of 512 tokens)."""
    import httpx

    from dflash_build.engines.backends import vllm

    target = trained["target"]
    drafter = {"method": "dflash", "path": str(trained["out"]), "options": {"num_speculative_tokens": DRAFT}}
    config = _drafted(target, tmp_path / "data", drafter)
    config["model"].pop("tool_call_parser")  # hermes looks for <tool_call> in the vocabulary: this one has none
    prompts = [[1, 300, 200, 45, 67, *CYCLE[i : i + 3]] for i in (0, 5, 10)]
    with served_url(config, tmp_path / "work") as url:
        answers = []
        for prompt in prompts:
            body = {"model": str(target), "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
            answers.append(answer["choices"][0]["token_ids"])
        totals = vllm.speculative_totals(httpx.get(f"{url}/metrics", timeout=30).text)
    for prompt, tokens in zip(prompts, answers, strict=True):
        start = CYCLE.index(prompt[-1]) + 1
        assert tokens == [CYCLE[(start + k) % len(CYCLE)] for k in range(16)], (prompt, tokens)
    print(f"served: {totals}")
    assert totals["drafted"] > 0 and totals["accepted"] >= 0.5 * totals["drafted"], totals


def toy_rows(n: int) -> list[dict[str, Any]]:
    """The toy target's own chats (its tokens, the answer's masked in): ``n`` training prompts of each category."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(toy_target.COMMITTED / "tokenizer.json"))
    asked = [p for c in toy_target.CATEGORIES for p in toy_target.prompts(c, n, seed=0)]
    chats = toy_target._encode(tok, [(p, toy_target.answer(p), False) for p in asked])
    return [{"input_ids": ids, "loss_mask": [0] * start + [1] * (len(ids) - start)} for ids, start in chats]


def eagle3_head(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The weights vLLM's Llama EAGLE-3 head (llama_eagle3.py) loads for ``config``: one layer whose attention
    reads the token's embedding and the hidden state side by side, fc over the three target layers."""
    h, d, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = {"self_attn.q_proj": (q, 2 * h), "self_attn.k_proj": (kv, 2 * h), "self_attn.v_proj": (kv, 2 * h),
             "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
             "mlp.down_proj": (h, inter), "input_layernorm": (h,), "hidden_norm": (h,),
             "post_attention_layernorm": (h,)}  # fmt: skip
    return {
        "embed_tokens.weight": (config["vocab_size"], h),
        "fc.weight": (h, 3 * config["target_hidden_size"]),
        **{f"layers.0.{name}.weight": shape for name, shape in layer.items()},
        "norm.weight": (h,),
        "lm_head.weight": (config["draft_vocab_size"], h),
    }


@pytest.mark.workflow
def test_automodels_eagle3_recipe_trains_a_head_vllm_loads(automodel_python: Path, tmp_path: Path) -> None:
    """Automodel's own EAGLE-3 recipe on the committed toy target and 128 of its chats (32 steps, about 10 s;
    built from empty: no other test trains EAGLE-3). What vLLM 0.32's CPU server loads as an ``eagle3`` drafter
    of the toy (checked by hand: 64% of 3 drafted tokens accepted after 150 steps; no server here)."""
    import transformers
    from safetensors import safe_open

    rows = write_jsonl(tmp_path / "rows.jsonl", toy_rows(64))
    run = write_run(
        tmp_path / "run" / "RUN.json", toy_target.COMMITTED, [rows], recipe="eagle3", settings=EAGLE3_SETTINGS
    )
    started = time.monotonic()
    proc = run_trainer(automodel_python, run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = logged_losses(proc.stdout)
    out = tmp_path / "run" / "drafter"
    record = json.loads((out / "train.json").read_text())
    print(f"eagle3: {time.monotonic() - started:.1f} s, loss {losses[0][2]} -> {losses[-1][2]}")
    assert [s for s, _, _ in losses] == list(range(1, 33)) and {m for _, m, _ in losses} == {32}, losses
    assert losses[-1][2] < losses[0][2] - 1.0, losses
    assert record["recipe"] == "eagle3" and record["steps"] == 32 and record["rows"] == 128
    assert record["final_loss"] == pytest.approx(losses[-1][2], abs=1e-4) and record["automodel"] == "0.7.0"
    assert record["settings"]["recipe_args"]["ttt_steps"] == 3 and record["settings"]["optimizer"]["lr"] == 3e-3
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["RUN.json", "drafter", "work"]

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3], "vLLM's count: the input of layer i + 1"
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] == config["vocab_size"]
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert loaded.num_hidden_layers == 1 and loaded.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    shapes = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(key)
                assert tensor.isfinite().all(), key
                shapes[key] = tuple(tensor.shape)
    assert shapes == eagle3_head(config)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(shapes)


# --- unit tier: bad input, one line each, before anything trains -----------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A target's config.json (nothing loads it before the checks) and a few good rows."""
    root = tmp_path_factory.mktemp("automodel-inputs")
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    llama = root / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    rows = write_jsonl(root / "rows.jsonl", synthetic_rows(4))
    return {"root": root, "target": target, "llama": llama, "rows": rows}


def _refused(python: Path, run: Path) -> str:
    proc = run_trainer(python, run, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (run.parent / "drafter").exists() and not (run.parent / "work").exists(), "nothing trained"
    return proc.stderr.strip()


def test_a_row_file_without_input_ids_or_loss_mask_is_named(
    automodel_python: Path, inputs: dict[str, Path], tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    no_mask = tmp_path / "no-mask.parquet"
    pq.write_table(pa.Table.from_pylist([{"input_ids": [1, 2, 3], "text": "a"}]), no_mask)
    said = _refused(
        automodel_python, write_run(tmp_path / "a" / "RUN.json", inputs["target"], [inputs["rows"], no_mask])
    )
    assert said == f"automodel: rows file {no_mask} has no loss_mask column (it has input_ids, text)"
    no_ids = write_jsonl(tmp_path / "no-ids.jsonl", [{"loss_mask": [0, 1]}])
    said = _refused(automodel_python, write_run(tmp_path / "b" / "RUN.json", inputs["target"], [no_ids]))
    assert said == f"automodel: rows file {no_ids} line 1 has no input_ids field"
    uneven = write_jsonl(tmp_path / "uneven.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}])
    said = _refused(automodel_python, write_run(tmp_path / "c" / "RUN.json", inputs["target"], [uneven]))
    assert said == f"automodel: rows file {uneven} row 1: 3 input_ids but 2 loss_mask values"


@pytest.mark.workflow  # imports the trainer in its own interpreter: 8-20 s, too slow for the unit tier
def test_a_target_automodels_dflash_registry_does_not_take_is_named_with_what_it_takes(
    automodel_python: Path, inputs: dict[str, Path], tmp_path: Path
) -> None:
    said = _refused(automodel_python, write_run(tmp_path / "RUN.json", inputs["llama"], [inputs["rows"]]))
    assert said.startswith(f"automodel: target {inputs['llama']} is LlamaForCausalLM: Automodel 0.7.0's DFlash "), said
    assert "Qwen3ForCausalLM" in said and "KimiK3" not in said and said.endswith(" only"), said


@pytest.mark.parametrize(
    ("recipe", "settings", "said"),
    [
        ("dflash", {"recipe_args": {"seq_lenght": 64}}, "settings.recipe_args.seq_lenght is not a setting of the "
         "automodel trainer's DFlash recipe; did you mean settings.recipe_args.seq_length?"),
        ("dflash", {"recipe_args": {"lr": 1e-3}}, "settings.recipe_args.lr is not a setting of the automodel "
         "trainer's DFlash recipe; did you mean settings.optimizer.lr?"),
        ("dflash", {"optimiser": {"lr": 1e-3}}, "settings.optimiser is not a section of settings; did you mean "
         "settings.optimizer?"),
        ("dflash", {"recipe_args": {"output_dir": "/x"}}, "settings.recipe_args.output_dir is the runner's "
         "(RUN.json's work); remove it"),
        ("dflash", {"recipe_args": {"block_size": "16"}}, 'settings.recipe_args.block_size must be a positive '
         'integer, not "16"'),
        ("dflash", {"recipe_args": {"block_size": 4}}, "settings.recipe_args.mask_token_id is required: a token id "
         "the target's data never holds (Automodel has no default)"),
        ("eagle3", {"recipe_args": {"ttt_step": 3}, "optimizer": {"lr": 1e-3}}, "settings.recipe_args.ttt_step is "
         "not a setting of the automodel trainer's EAGLE-3 recipe; did you mean settings.recipe_args.ttt_steps?"),
        ("eagle3", {"recipe_args": {"ttt_steps": 3}}, "settings.optimizer.lr is required: the peak learning rate "
         "(Automodel has no default)"),
    ],
)  # fmt: skip
def test_a_setting_the_trainer_does_not_know_is_named_with_the_closest(
    automodel_python: Path, inputs: dict[str, Path], tmp_path: Path, recipe: str, settings: dict[str, Any], said: str
) -> None:
    run = write_run(tmp_path / "RUN.json", inputs["target"], [inputs["rows"]], recipe=recipe, settings=settings)
    assert _refused(automodel_python, run) == f"automodel: {said}"


def test_an_out_folder_that_exists_is_refused(automodel_python: Path, inputs: dict[str, Path], tmp_path: Path) -> None:
    run = write_run(tmp_path / "RUN.json", inputs["target"], [inputs["rows"]])
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "x").write_text("")
    proc = run_trainer(automodel_python, run, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == f"automodel: out {tmp_path / 'drafter'} exists: the " \
        "runner publishes a new folder there", proc.stderr  # fmt: skip


def test_a_work_folder_of_something_else_is_left_alone(
    automodel_python: Path, inputs: dict[str, Path], tmp_path: Path
) -> None:
    """Automodel resumes from any checkpoint in its folder: the runner empties only a former run's."""
    run = write_run(tmp_path / "RUN.json", inputs["target"], [inputs["rows"]])
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    proc = run_trainer(automodel_python, run, timeout=120)
    said = f"automodel: work {tmp_path / 'work'} holds files of something else; give an empty or absent folder " \
        "(Automodel resumes from any checkpoint there)"  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.strip() == said, proc.stderr
    assert (tmp_path / "work" / "notes.txt").read_text() == "mine"


def test_an_environment_without_nemo_automodel_says_so_in_one_line(inputs: dict[str, Path], tmp_path: Path) -> None:
    """The project's own environment has no Automodel (the build runs the trainer in its own)."""
    said = _refused(Path(sys.executable), write_run(tmp_path / "RUN.json", inputs["target"], [inputs["rows"]]))
    assert said == f"automodel: nemo_automodel is not installed in {sys.prefix} (`make setup` creates " \
        ".venv-automodel, envs/automodel.txt)"  # fmt: skip


# --- unit tier: the descriptor's settings are the pinned recipes' -----------------------------------------------


@pytest.mark.parametrize(("recipe", "module"), [("dflash", "train_dflash.py"), ("eagle3", "train_eagle3.py")])
def test_every_setting_of_the_descriptor_is_read_by_the_pinned_recipe(
    automodel_python: Path, recipe: str, module: str
) -> None:
    """Each key of the descriptor's recipe is one its recipe's source reads (``recipe_cfg`` is its
    recipe_args, ``opt_cfg`` its optimizer section), in the interpreter's installed release (read as text)."""
    [source] = automodel_python.parent.parent.glob(f"lib/python3*/site-packages/nemo_automodel/recipes/llm/{module}")
    text = source.read_text()
    unread = [
        f"{section}.{key}"
        for section, keys in automodel.TRAINER.recipe(recipe).settings.items()
        for key in keys
        if not re.search(rf'{"recipe_cfg" if section == "recipe_args" else "opt_cfg"}(\.get\("{key}"|\.{key}\b)', text)
    ]
    assert not unread, f"{source} reads no {', '.join(unread)}"


# --- unit tier: the CPU patches check the release and the code they change --------------------------------------

PATCH_PROBE = """
import importlib.metadata, json, sys
sys.path.insert(0, sys.argv[1])
import automodel_run as runner
from automodel_recipes_run import RECIPES
from nemo_automodel.components.speculative.dflash.registry import DFLASH_DRAFT_REGISTRY
from nemo_automodel.components.speculative.eagle.registry import EAGLE3_DRAFT_REGISTRY

said = {"targets": {"dflash": sorted(DFLASH_DRAFT_REGISTRY), "eagle3": sorted(EAGLE3_DRAFT_REGISTRY)}}
def attempt(name, call):
    try:
        call()
        said[name] = None
    except runner.Stop as e:
        said[name] = str(e)

dflash, eagle3 = RECIPES["dflash"], RECIPES["eagle3"]
td, te = runner.import_automodel(dflash), runner.import_automodel(eagle3)
attempt("release", runner.installed_release)
attempt("pristine", lambda: runner.patch_automodel(td, dflash, [], print))
attempt("pristine_eagle3", lambda: runner.patch_automodel(te, eagle3, [], print))
real = importlib.metadata.version
importlib.metadata.version = lambda name: "0.8.0" if name == "nemo_automodel" else real(name)
attempt("other_release", runner.installed_release)
importlib.metadata.version = real
recipe = td.TrainDFlashRecipe
loader, target = td.build_eagle3_dataloader, recipe._build_target_model
td.build_eagle3_dataloader = None
attempt("no_loader", lambda: runner.patch_automodel(td, dflash, [], print))
td.build_eagle3_dataloader = loader
def _build_target_model(self, recipe_cfg, target_path, draft_spec):  # a release that loads the target on CPU
    return None
recipe._build_target_model = _build_target_model
attempt("cpu_loader", lambda: runner.patch_automodel(td, dflash, [], print))
recipe._build_target_model = target
def _setup_colocated_target(self, recipe_cfg, target_path, draft_base_config):  # the same, of EAGLE-3's
    return None
te.TrainEagle3Recipe._setup_colocated_target = _setup_colocated_target
attempt("cpu_loader_eagle3", lambda: runner.patch_automodel(te, eagle3, [], print))
print(json.dumps(said))
"""


@pytest.mark.workflow  # imports the trainer in its own interpreter: 8-20 s, too slow for the unit tier
def test_the_cpu_patches_apply_to_0_7_0_and_name_themselves_where_the_code_is_not_theirs(
    automodel_python: Path,
) -> None:
    """Both recipes' patches, and the target architectures the descriptor lists are its registries' own."""
    proc = subprocess.run(
        [str(automodel_python), "-c", PATCH_PROBE, str(RUNNER.parent)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert said["release"] is None and said["pristine"] is None and said["pristine_eagle3"] is None, said
    assert said["other_release"] == (
        "nemo_automodel 0.8.0 is installed; the CPU patches (triton, tokens_loader, cpu_target, progress) were "
        "written for 0.7.0 (envs/automodel.txt pins it)"
    )
    assert said["no_loader"].startswith("nemo_automodel 0.7.0's code is not what the CPU patch tokens_loader was "), (
        said
    )
    assert said["cpu_loader"].startswith("nemo_automodel 0.7.0's code is not what the CPU patch cpu_target was "), said
    assert said["cpu_loader_eagle3"].startswith(
        "nemo_automodel 0.7.0's code is not what the CPU patch cpu_target was written for (its module "
    ) and said["cpu_loader_eagle3"].endswith("train_eagle3.py)"), said
    for name, recipe in automodel.TRAINER.recipes.items():
        assert sorted(recipe.targets) == said["targets"][name], name
