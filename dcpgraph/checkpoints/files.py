"""Which dtypes a model directory may be loaded in, and which safetensors files hold its weights."""

from __future__ import annotations

import json
import os

import torch

from ..errors import ConfigError

DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def weight_files(path: str) -> tuple[str, ...]:
    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [name for name in files if not os.path.exists(os.path.join(path, name))]
        if missing:
            raise ConfigError(f"{path}: {_INDEX} names weight files that are missing: {missing}")
        return tuple(files)
    if os.path.exists(os.path.join(path, _SINGLE)):
        return (_SINGLE,)
    present = sorted(os.listdir(path))
    raise ConfigError(f"{path}: no safetensors weights ({_SINGLE} or {_INDEX}); the directory holds {present}")
