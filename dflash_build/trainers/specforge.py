"""SpecForge (``specforge``, pinned): its own ``specforge train`` command trains the DFlash drafter and
``specforge export --to hf`` writes the checkpoint an engine serves; nothing here is a training loop.

SpecForge 0.2.0 trains DFlash in one of two modes (``specforge/config/schema.py``, ``Config.mode``):
online, from token rows whose target hidden states an external SGLang capture server computes while the
drafter trains (``data.prompts_path``), and offline, from hidden states precomputed into ``.ckpt`` files
(``data.hidden_states_path``; SpecForge's own producer of them needs SGLang too). The build trains online
on the dataset's own token rows: the runner (:mod:`dflash_build.trainers.specforge_run`) writes them as
SpecForge's pre-tokenized prompts JSONL and asks for SpecForge's ``managed_local`` deployment, in which
``specforge train`` starts everything itself on one node: a Mooncake master, a patched SGLang 0.5.14
capture server on the first GPUs and the trainer on the others (``deployment.mode: disaggregated``,
``deployment.disaggregated.backend: mooncake``, ``model.target_backend: sglang``: the only online
deployment 0.2.0 has). That is why it cannot run on a machine without CUDA GPUs (:func:`runs_here`).

The trainer's interpreter (``.venv-specforge``: ``pip install specforge==0.2.0`` with its dependencies,
torch 2.11.0, transformers 5.8.1 and sglang 0.5.14, then SpecForge's own
``scripts/apply_sglang_spec_capture_patch.sh --python .venv-specforge/bin/python`` from its GitHub
repository, which the wheel does not ship, and Mooncake's ``mooncake_master`` and ``mooncake.store``)
has SpecForge, not this package: the runner is a script of its own.

The settings are SpecForge's own config sections and keys (``training``, ``model``, ``data``), as the
pinned release's pydantic classes name them, with their defaults; ``capture_server`` is the one capture
server of the managed deployment (``deployment.disaggregated.managed_local.capture_servers[0]``,
``ManagedLocalCaptureServerConfig``). The run's paths, the strategy, the deployment's ports and the split
of the GPUs between the capture server and the trainer are the runner's. A setting that changes the
weights enters the train key; one that changes only speed, memory or logging does not.
tests/test_trainer_specforge.py checks every key and default against the pinned classes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from dflash_build.trainers.base import Recipe, Setting, Trainer, progress, runner_command

VERSION = "0.2.0"
VENV = ".venv-specforge"
RUNNER = Path(__file__).with_name("specforge_run.py")

# The section each settings section is written to, by the pinned release's class that reads it
# (specforge/config/schema.py): what the contract test compares keys and defaults with.
SECTIONS = {
    "training": "TrainingConfig",
    "model": "ModelConfig",
    "data": "DataConfig",
    "capture_server": "ManagedLocalCaptureServerConfig",
}

DFLASH = {
    "training": {
        "num_epochs": Setting(1),
        "max_steps": Setting(None),  # null: the data's own steps (prompts x epochs over the global batch)
        "batch_size": Setting(1),
        "accumulation_steps": Setting(1),
        "learning_rate": Setting(1e-4),
        "lr_scheduler": Setting("cosine"),
        "warmup_ratio": Setting(0.015),
        "max_grad_norm": Setting(0.5),
        "num_anchors": Setting(512),
        "loss_decay_gamma": Setting(None),
        "loss_type": Setting("dflash"),
        "dpace_alpha": Setting(0.5),  # the dpace losses' own weight
        "seed": Setting(42),
        "prompt_seed": Setting(None),  # the online prompt order; null: seed
        # how fast, in how much memory or how verbosely, not what: out of the key
        "attention_backend": Setting("flex_attention", weights=False),
        "objective_chunk_blocks": Setting(128, weights=False),
        "save_interval": Setting(0, weights=False),
        "max_checkpoints": Setting(0, weights=False),
        "log_interval": Setting(50, weights=False),
    },
    "model": {
        "draft_num_hidden_layers": Setting(None),  # null: 1 (the draft config SpecForge derives from the target)
        "draft_block_size": Setting(None),  # null: 16
        "mask_token_id": Setting(None),  # null: the draft config's, then the tokenizer's (training/model_utils.py)
        "torch_dtype": Setting("bfloat16"),  # the target's capture and the training model's dtype
        "sglang_mem_fraction_static": Setting(0.4, weights=False),
    },
    "data": {
        "max_length": Setting(2048),
    },
    "capture_server": {
        "tp_size": Setting(1, weights=False),  # the capture server's GPUs; the trainer gets the rest of train.gpus
    },
}

# The target architectures SGLang 0.5.14 captures DFlash features from: the entry classes of
# sglang/srt/models/ that have (or inherit) ``set_dflash_layers_to_capture``, which the capture patch's
# ``--spec-capture-method dflash`` calls (model_runner.py), drafts and MTP heads left out. An upper bound:
# the server refuses a model without the hook when it starts, and nothing here has run one on a GPU.
TARGETS = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration",
    "Glm4MoeLiteForCausalLM",
    "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM",
    "IQuestCoderForCausalLM",
    "InternLM3ForCausalLM",
    "InternS1ProForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration",
    "KimiK25ForConditionalGeneration",
    "Llama4ForCausalLM",
    "LlamaForCausalLM",
    "Ministral3ForCausalLM",
    "MistralForCausalLM",
    "MistralLarge3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "TeleFLMForCausalLM",
)


def venv_python() -> Path:
    """The interpreter `make setup` builds for SpecForge, in the repository's root."""
    return Path(__file__).resolve().parents[2] / VENV / "bin" / "python"


def _gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0


_CHECK = (
    "import importlib.util as u\n"
    "for name in ('sglang.srt.spec_capture_sink', 'mooncake.store'):\n"
    "    try:\n"
    "        found = u.find_spec(name) is not None\n"
    "    except ModuleNotFoundError:\n"
    "        found = False\n"
    "    if not found:\n"
    "        print(name)\n"
)


def runs_here() -> str | None:
    """Why SpecForge's online DFlash run cannot start on this machine (None: it can, as far as can be seen
    without starting it)."""
    why = (
        f"SpecForge {VERSION} trains DFlash online only, on target hidden states a patched SGLang 0.5.14 "
        "capture server computes (model.target_backend: sglang) and Mooncake carries to the trainer "
        "(deployment.mode: disaggregated)"
    )
    gpus = _gpus()
    if gpus < 2:
        return f"{why}: it needs two CUDA GPUs or more (the capture server's, the trainer's); this machine has {gpus}"
    python = venv_python()
    if not python.exists():
        return f"{why}: `make setup` builds {VENV} with it, and there is no {python}"
    if shutil.which("mooncake_master") is None and not (python.parent / "mooncake_master").exists():
        return f"{why}: Mooncake's mooncake_master is neither on PATH nor in {python.parent}"
    try:
        done = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{why}: {python} does not run ({type(e).__name__})"
    missing = done.stdout.split()
    if done.returncode != 0 or missing:
        return (
            f"{why}: {python} lacks {', '.join(missing) or 'a working import system'} (SpecForge's "
            "scripts/apply_sglang_spec_capture_patch.sh patches SGLang; mooncake-transfer-engine has Mooncake)"
        )
    return None


TRAINER = Trainer(
    name="specforge",
    package="specforge",
    version=VERSION,
    venv=VENV,
    recipes={"dflash": Recipe("dflash", DFLASH, TARGETS)},
    command=runner_command(RUNNER),
    progress=progress,
    runs_here=runs_here,
)
