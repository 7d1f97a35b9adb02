"""The SpecForge trainer backend against the pinned release (specforge 0.2.0, installed --no-deps by
`make setup`): the config its runner writes is one SpecForge validates, resolves and plans; its settings
are SpecForge's own keys with SpecForge's own defaults; the prompts file is what SpecForge's own loader
reads as the dataset's rows; its progress lines are read from SpecForge's own log lines.

What needs SGLang and GPUs is not run here: ``specforge train`` itself (the patched SGLang capture
server, Mooncake and the trainer's ranks), whose plan is checked instead. The export half of the runner
(``specforge export --to hf`` of a checkpoint, the record, the rename to ``out``) runs on the CPU in the
workflow tier, on a checkpoint of SpecForge's own DFlash draft model made here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import specforge.config as sf_config
from specforge.application import resolve_run
from specforge.data.prompt_builder import prepare_prompt_tasks
from specforge.training.assembly import _logger as specforge_logger
from specforge.training.schedule import resolve_online_total_steps

from dflash_build.spec import ConfigError
from dflash_build.trainers import registry
from dflash_build.trainers import specforge as sf
from dflash_build.trainers import specforge_run as runner
from dflash_build.trainers.base import TRAINER_RECORD, Run

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

# (input_ids, loss_mask): what SpecForge's DFlash loader does with each at max_length 6
ROWS = [
    ([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]),  # kept whole
    ([6, 7, 8, 9], [0, 1, 0, 1]),  # no two adjacent supervised tokens: dropped
    ([10, 11, 12, 13, 14, 15, 16, 17, 18], [0, 0, 0, 1, 1, 1, 1, 1, 1]),  # cut at 6
    ([19, 20, 21], [0, 0, 1]),  # one supervised token: dropped
    ([22, 23, 24, 25, 26, 27, 28, 29], [0, 0, 0, 0, 0, 0, 1, 1]),  # supervised only past the window: dropped
    ([30, 31, 32], [1, 1, 0]),  # kept
]
MAX_LENGTH = 6


@pytest.fixture(autouse=True)
def _every_gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner counts the GPUs CUDA_VISIBLE_DEVICES leaves it: a value another test of this worker left
    in the environment would be taken for the node's."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _target(root: Path) -> Path:
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TINY_QWEN3))
    return target


def _rows(root: Path) -> Path:
    path = root / "rows.parquet"
    table = {
        "prompt_id": [f"p{i}" for i in range(len(ROWS))],
        "sample_idx": [0] * len(ROWS),
        "input_ids": [ids for ids, _ in ROWS],
        "loss_mask": [mask for _, mask in ROWS],
    }
    pq.write_table(pa.table(table), path)
    return path


def _run(root: Path, given: dict[str, Any], gpus: int = 3) -> Run:
    settings = sf.TRAINER.settings("dflash", given)
    return Run("dflash", _target(root), (_rows(root),), root / "drafter", root / "trainer", settings, gpus)


def _run_file(run: Run) -> Path:
    path = run.work.parent / "run.json"
    path.write_text(json.dumps(run.as_dict()))
    return path


GIVEN = {
    "training": {"learning_rate": 3e-4, "max_steps": 5, "seed": 7, "attention_backend": "sdpa"},
    "model": {"draft_num_hidden_layers": 2, "mask_token_id": 3},
    "data": {"max_length": MAX_LENGTH},
}


@pytest.mark.workflow  # imports the trainer in its own interpreter: 8-20 s, too slow for the unit tier
def test_the_runner_writes_a_config_specforge_validates_resolves_and_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run = _run(tmp_path, GIVEN)
    done = subprocess.run(
        [sys.executable, str(sf.RUNNER), str(_run_file(run)), "--plan"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout)

    path = run.work / runner.CONFIG
    cfg = sf_config.load_config(str(path))
    again = sf_config.Config.model_validate(json.loads(json.dumps(cfg.model_dump())))
    assert again == cfg
    resolved = resolve_run(cfg)
    assert resolved.algorithm.name == "dflash" and cfg.mode == "online"
    classes = {"training": cfg.training, "model": cfg.model, "data": cfg.data}
    classes["capture_server"] = cfg.deployment.disaggregated.managed_local.capture_servers[0]
    for section, values in run.settings.items():
        for key, value in values.items():
            assert getattr(classes[section], key) == value, f"{section}.{key}"
    assert cfg.model.target_model_path == str(run.target)
    assert cfg.data.prompts_path == str(run.work / runner.PROMPTS)
    assert Path(cfg.output_dir).parent == run.work

    # the plan: Mooncake and one capture server of the target on GPU 0, the trainer's two ranks on 1 and 2
    assert plan["kind"] == "managed_supervisor" and plan["role"] == "both"
    services = {s["command"]["label"]: s["command"] for s in plan["services"]}
    assert services["mooncake"]["argv"][0] == "mooncake_master"
    capture = services["capture-server-0"]
    argv = capture["argv"]
    assert argv[argv.index("--model-path") + 1] == str(run.target)
    assert argv[argv.index("--spec-capture-method") + 1] == "dflash"
    layers = argv[argv.index("--spec-capture-aux-layer-ids") + 1 : argv.index("--host")]
    assert layers == ["1", "5"]  # SpecForge's build_target_layer_ids(8 target layers, 2 draft layers)
    assert capture["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    commands = {c["label"]: c for c in plan["commands"]}
    assert commands["consumer"]["env"]["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert "--nproc_per_node" in commands["consumer"]["argv"]
    assert commands["producer"]["argv"][-2:] == ["--role", "producer"]


def test_every_setting_is_the_pinned_classes_key_with_its_default() -> None:
    assert set(sf.SECTIONS) == set(sf.DFLASH)
    for section, settings in sf.DFLASH.items():
        fields = getattr(sf_config, sf.SECTIONS[section]).model_fields
        for key, setting in settings.items():
            assert key in fields, f"{section}.{key}: specforge {sf.VERSION}'s {sf.SECTIONS[section]} has no such key"
            default = fields[key].get_default(call_default_factory=True)
            assert setting.default == default and type(setting.default) is type(default), f"{section}.{key}"
            assert not setting.required
    assert registry.get("specforge") is sf.TRAINER
    assert sf.TRAINER.version == sf.VERSION


def test_an_unknown_key_or_section_is_refused_with_the_closest_name() -> None:
    with pytest.raises(ConfigError) as key:
        sf.TRAINER.settings("dflash", {"training": {"learning_rat": 1e-4}})
    assert key.value.key == "train.settings.training.learning_rat"
    assert "'learning_rate'" in str(key.value) and "specforge 0.2.0" in str(key.value)
    with pytest.raises(ConfigError) as section:
        sf.TRAINER.settings("dflash", {"trainig": {}})
    assert "'training'" in str(section.value)
    with pytest.raises(ConfigError):  # SpecForge's key, but the runner's to set
        sf.TRAINER.settings("dflash", {"data": {"prompts_path": "x.jsonl"}})
    filled = sf.TRAINER.settings("dflash", {"training": {"max_steps": 3}})
    assert filled["training"]["max_steps"] == 3 and filled["training"]["learning_rate"] == 1e-4
    keyed = sf.TRAINER.keyed("dflash", filled)
    assert "log_interval" not in keyed["training"] and keyed["capture_server"] == {}


def _loaded(path: Path, cfg: sf_config.Config) -> list[dict[str, list[int]]]:
    """SpecForge's own online loader, with the options and DFlash filters its assembly passes
    (training/assembly.py, _prepare_prompts)."""
    model = resolve_run(cfg).algorithm.providers.model
    tasks = prepare_prompt_tasks(
        path,
        None,  # pre-tokenized rows need no tokenizer
        chat_template=cfg.data.chat_template,
        max_length=cfg.data.max_length,
        is_preformatted=cfg.data.is_preformatted,
        train_only_last_turn=cfg.data.train_only_last_turn,
        cache_dir=None,
        cache_key=None,
        num_proc=cfg.data.build_dataset_num_proc,
        min_loss_tokens=model.minimum_loss_tokens(cfg, {"block_size": 16}),
        max_prompts=cfg.data.max_prompts,
        loss_mask_filter=model.loss_mask_filter,
    )
    return [task["payload"] for task in tasks]


def test_the_prompts_file_is_what_specforges_loader_reads_of_the_dataset(tmp_path: Path) -> None:
    run = _run(tmp_path, GIVEN)
    run.work.mkdir()
    counts = runner.write_prompts([str(p) for p in run.rows], run.work / runner.PROMPTS, MAX_LENGTH)
    written = [json.loads(line) for line in (run.work / runner.PROMPTS).read_text().splitlines()]

    cfg = sf_config.Config.model_validate(runner.config(run.as_dict(), run.work, [1001, 1002, 1003, 1004]))
    model = resolve_run(cfg).algorithm.providers.model
    assert model.minimum_loss_tokens(cfg, {"block_size": 16}) == runner.MIN_LOSS_TOKENS  # DFlash's own minimum
    # the dataset's rows as they are, read by SpecForge itself: what it would train on
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"input_ids": i, "loss_mask": m}) + "\n" for i, m in ROWS))
    expected = _loaded(raw, cfg)
    assert [r["input_ids"] for r in expected] == [
        [1, 2, 3, 4, 5],
        [10, 11, 12, 13, 14, 15],
        [30, 31, 32],
    ]
    assert _loaded(run.work / runner.PROMPTS, cfg) == expected
    assert [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in written] == expected
    assert [r["id"] for r in written] == ["p0:0", "p2:0", "p5:0"]
    assert counts["rows_in"] == len(ROWS) and counts["rows"] == 3 and counts["cut_at_max_length"] == 1
    assert counts["dropped"] == {runner.DROP_FEW_LOSS: 2, runner.DROP_NOT_ADJACENT: 1}


def test_the_runner_prints_specforges_logged_steps_as_progress(capsys: pytest.CaptureFixture[str]) -> None:
    specforge_logger({"loss": 2.5, "accuracy": 0.25, "lr": 1e-4}, 3)  # SpecForge's own console line
    specforge_logger({"train/loss": 1.75}, 6)  # through a tracker
    logged = capsys.readouterr().out.splitlines()
    follow = runner.Follow(10)
    for line in [*logged, logged[0], "step 4: {'accuracy': 0.5}", "Training: 40%"]:
        follow.line(line)
    seen = [p for line in capsys.readouterr().out.splitlines() if (p := sf.progress(line)) is not None]
    assert seen == [{"step": "3/10", "loss": 2.5}, {"step": "6/10", "loss": 1.75}]
    assert (follow.step, follow.loss) == (6, 1.75)


@pytest.mark.parametrize(
    ("prompts", "gpus", "batch", "accumulation", "epochs", "cap"),
    [(10, 3, 1, 1, 1, None), (37, 5, 2, 3, 2, None), (37, 2, 1, 1, 3, 20)],
)
def test_the_runners_step_count_is_specforges_online_schedule(
    tmp_path: Path, prompts: int, gpus: int, batch: int, accumulation: int, epochs: int, cap: int | None
) -> None:
    given = {
        "training": {"batch_size": batch, "accumulation_steps": accumulation, "num_epochs": epochs, "max_steps": cap}
    }
    run = _run(tmp_path, given, gpus=gpus)
    cfg = runner.config(run.as_dict(), run.work, [1001, 1002, 1003, 1004])
    steps = resolve_online_total_steps(
        num_prompts=prompts, prompt_epochs=epochs, dp_size=gpus - 1, batch_size=batch, accumulation_steps=accumulation
    )
    assert runner.optimizer_steps(cfg, prompts) == (min(steps, cap) if cap else steps)
    sf_config.Config.model_validate(cfg)  # a global batch past the producer's window widens it


def test_the_runner_refuses_too_few_gpus_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run = _run(tmp_path, {"capture_server": {"tp_size": 2}}, gpus=2)
    with pytest.raises(SystemExit, match=r"capture_server.tp_size.*train.gpus is 2"):
        runner.config(run.as_dict(), run.work)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    cfg = runner.config(run.as_dict() | {"gpus": 3}, run.work)
    managed = cfg["deployment"]["disaggregated"]["managed_local"]
    assert managed["capture_servers"][0]["cuda_visible_devices"] == ["4", "6"]
    assert managed["trainer_cuda_visible_devices"] == ["7"]


def test_it_says_why_it_cannot_run_on_a_machine_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sf, "_gpus", lambda: 0)
    why = sf.runs_here()
    assert why is not None and "SGLang" in why and "GPUs" in why and "has 0" in why
    assert sf.TRAINER.command("py", Path("run.json"), None) == ["py", str(sf.RUNNER), "run.json"]  # type: ignore[arg-type]


@pytest.mark.workflow  # two torch imports and a draft model: about 15 s
def test_the_runner_exports_the_newest_checkpoint_whole_with_its_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner end to end with ``specforge train`` replaced by a stand-in that leaves what it leaves (a
    checkpoint of SpecForge's own DFlash draft model, its log lines): ``specforge export --to hf`` runs
    for real, on the CPU."""
    import torch
    from specforge.modeling.auto import AutoDraftModel
    from specforge.training.model_loading import resolve_draft_config

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    run = _run(tmp_path, GIVEN)

    def train(argv: list[str], work: Path, follow: runner.Follow) -> int:
        cfg = sf_config.load_config(argv[argv.index("-c") + 1])
        draft = resolve_draft_config(cfg, provider=resolve_run(cfg).algorithm.providers.model.draft_config)
        state = {k: v for k, v in AutoDraftModel.from_config(draft).state_dict().items() if "embed" not in k}
        for step in (1, 2):
            folder = Path(cfg.output_dir) / f"{runner.RUN_ID}-step{step}"
            folder.mkdir(parents=True)
            torch.save(
                {
                    "draft_state_dict": state,
                    "global_step": step,
                    "dflash_mask_token_id": 3,
                    "dflash_target_layer_ids": (1, 5),
                    "dflash_block_size": 16,
                },
                folder / "training_state.pt",
            )
            follow.line(f"step {step}: {{'loss': {3.0 / step}, 'accuracy': 0.1}}")
        return 0

    monkeypatch.setattr(runner, "train", train)
    assert runner.main([str(_run_file(run))]) == 0
    assert sorted(p.name for p in run.out.iterdir()) == ["config.json", "model.safetensors", TRAINER_RECORD]
    assert not list(run.out.parent.glob(f".{run.out.name}*"))
    config = json.loads((run.out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]  # vLLM's name
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 5]}
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 16
    record = json.loads((run.out / TRAINER_RECORD).read_text())
    assert (
        record["steps"] == 2
        and record["final_loss"] == 1.5
        and record["train_seconds"] >= 0
        and record["version"] == sf.VERSION
    )
    assert record["checkpoint"] == f"{runner.RUN_ID}-step2" and record["data"]["rows"] == 3
