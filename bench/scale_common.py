"""What the scale benchmark's measurements share: a config for a folder of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def config(root: Path, sources: dict[str, Any], model: Path | None = None, **extra: Any) -> Any:
    import yaml

    from dflash_build import config as cfg

    if model is None:
        model = root / "model.gguf"
        if not model.exists():
            model.write_bytes(b"GGUF")
    raw = {
        "store": str(root / "store"),
        "logs": str(root / "logs"),
        "dataset": {"name": "bench", "out": str(root / "dist")},
        "model": {"path": str(model)},
        "mix": {"categories": {s["category"]: 1 / len(sources) for s in sources.values()}},
        "sources": sources,
        **extra,
    }
    (root / "config.yaml").write_text(yaml.safe_dump(raw))
    return cfg.load(root / "config.yaml")
