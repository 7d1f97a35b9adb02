"""`dflash-build preflight` on a single-GPU machine that has torch and transformers but neither vLLM nor SGLang:
the demo's prompts, the model folder given, the transformers backend on `cuda` as one shared engine. It says
what it measured (the environment, the GPU's architecture against torch's wheel, the engine, the pilot's
speed) and exits 1 on FAIL. Not part of CI: for whenever such a machine is at hand.

    pip install -e .                                  # the package and its dependencies, on that machine
    python bench/gpu/preflight.py --model /path/to/Qwen3-0.6B [--rows 8] [--workdir /tmp/gpu-preflight]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def config(model: str, workdir: Path, rows: int) -> dict:
    """The demo's config with this model on GPU 0 through the transformers backend."""
    raw = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    raw["store"], raw["logs"] = str(workdir / "store"), str(workdir / "logs")
    raw["dataset"] = {"name": "gpu-preflight", "out": str(workdir / "dist")}
    raw["model"] = {"path": model, "chat_template_kwargs": {}}  # the model's own template
    raw["engine"] = {
        "backend": "transformers",
        "options": {"device": "cuda", "dtype": "bfloat16", "batch_size": 16},
        "shared": True,
        "gpus": ["0"],
        "lock_dir": str(workdir / "locks"),
    }
    raw["preflight"] = {"rows": rows}
    raw.pop("export", None)
    raw.pop("pack", None)
    for source in raw["sources"].values():
        source["files"] = [str(REPO / f) for f in source["files"]]
    return raw


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a transformers model folder")
    parser.add_argument("--rows", type=int, default=8, help="pilot prompts per source")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gpu-preflight"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config(args.model, args.workdir, args.rows)))
    done = subprocess.run([sys.executable, "-m", "dflash_build", "--configfile", str(path), "preflight"], cwd=REPO)
    print(f"summary: {args.workdir / 'logs' / 'preflight' / 'gpu-preflight.json'} (and .md)")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
