"""LoRA adapters out as PEFT writes them: ``jzero export CHECKPOINT --peft OUT``.

``OUT/adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules`` as the
adapted modules' own names, ``base_model_name_or_path``: the checkpoint's Hugging Face directory)
and ``OUT/adapter_model.safetensors`` with PEFT's key names: the base tensor's name
(`jzero.runtime.hf.RENAMES`) under ``base_model.model.``, ``.weight`` becoming
``.lora_A.weight`` (``[r, in]``) and ``.lora_B.weight`` (``[out, r]``), one pair a layer
(``target_modules`` carry the parent's name too, ``attn.c_proj``, so that GPT-2's two ``c_proj``
stay apart). PEFT
then loads it onto the transformers model of that directory (``PeftModel.from_pretrained``).
GPT-2's Conv1D layers keep their weights ``[in, out]``: the config says ``fan_in_fan_out``, as
PEFT's own GPT-2 adapters do. The folder appears whole or not at all.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jzero.config import ConfigError
from jzero.models import hfconfig, lora
from jzero.runtime import hf
from jzero.runtime.weights import resolve

PREFIX = "base_model.model."


def export_peft(checkpoint: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """Write ``checkpoint``'s adapters as a PEFT adapter folder ``out`` (module docstring)."""
    ckpt, step = resolve(checkpoint)
    record = ckpt.record(step)
    adapters = lora.from_raw(record["config"])
    source = record["config"].get("jzero", {}).get("model", {}).get("hf")
    if adapters is None:
        raise ConfigError(f"export --peft: {checkpoint} has no LoRA adapters (its config has no jzero.lora)")
    if source is None or not (Path(source) / "config.json").is_file():
        where = "not from a Hugging Face directory" if source is None else f"from {source}, which is gone"
        raise ConfigError(f"export --peft: {checkpoint} was trained {where}: PEFT adapters name the modules of a "
                          "Hugging Face base model")
    family = hfconfig.from_dict(hfconfig.read(source)).name
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"export --peft: {out} exists and is not empty")
    tensors, modules = {}, set()
    for name in sorted(record["leaves"]):
        if not (name.startswith("params/") and name.endswith(f"/{lora.A}")):
            continue
        module = name.removeprefix("params/").rsplit("/", 1)[0]
        pattern, _ = hf.hf_name(family, f"{module}/kernel")
        a, b = (ckpt.read_array(step, f"params/{module}/{key}") for key in (lora.A, lora.B))
        stacked = "{i}" in pattern
        for i in range(a.shape[0]) if stacked else [None]:
            base = pattern.format(i=i).removesuffix(".weight")
            layer_a, layer_b = (a, b) if i is None else (a[i], b[i])
            tensors[f"{PREFIX}{base}.lora_A.weight"] = np.ascontiguousarray(layer_a.T, np.float32)
            tensors[f"{PREFIX}{base}.lora_B.weight"] = np.ascontiguousarray(layer_b.T, np.float32)
        modules.add(".".join(base.split(".")[-2:]))  # "self_attn.q_proj": PEFT matches name ends
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapters.r, "lora_alpha": adapters.alpha,
                "lora_dropout": adapters.dropout, "target_modules": sorted(modules), "bias": "none",
                "fan_in_fan_out": family == "gpt", "base_model_name_or_path": str(Path(source).resolve()),
                "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
                "use_dora": False}
    _write(out, settings, tensors)
    return {"step": step, "tensors": len(tensors), "modules": sorted(modules), "path": str(out)}


def _write(out: Path, settings: dict, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "adapter_config.json").write_text(json.dumps(settings, indent=2) + "\n")
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
