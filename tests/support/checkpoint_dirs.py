"""Checkpoint directories in the real layouts (ms-swift, Megatron, merged), tiny sizes, real safetensors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from orchestrator.store import checkpoints as ck

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def write_adapter(path: Path, rank: int = 8, layers: int = 2, lora: bool = True, step: int = 0) -> None:
    """Writes a LoRA adapter (or plain weights); `step` moves lora_B, as training between two saves does."""
    t = {}
    for i in range(layers):
        for mod in ("q_proj", "v_proj"):
            base = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            if lora:
                t[f"{base}.lora_A.weight"] = np.full((rank, 16), 0.01 * (i + 1), np.float32)
                t[f"{base}.lora_B.weight"] = np.full((16, rank), 0.02 + 1e-4 * step, np.float32)
            else:
                t[f"{base}.weight"] = np.ones((16, 16), np.float32)
    save_file(t, str(path), metadata={"format": "pt"})


def adapter_config(d: Path, rank: int = 8, alpha: int = 32, targets=TARGETS) -> None:
    (d / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "lora_dropout": 0.05}))


def link_last(out: Path, step: int) -> None:
    link = out / "last-checkpoint"
    if link.is_symlink():
        link.unlink()
    link.symlink_to(f"checkpoint-{step}")


def make_swift(out: Path, step: int, rank: int = 8, loss: float | None = 1.0, link: bool = True,
               state: bool = True, big: int = 0) -> Path:
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    write_adapter(d / "adapter_model.safetensors", rank)
    adapter_config(d, rank)
    (d / "README.md").write_text("peft card\n")
    (d / "additional_config.json").write_text('{"lora_dtype": null}')
    (d / "args.json").write_text(json.dumps({"output_dir": str(out), "lora_rank": rank}))
    (d / "optimizer.pt").write_bytes(os.urandom(big or 2048))
    (d / "rng_state.pth").write_bytes(os.urandom(big or 512))
    (d / "scheduler.pt").write_bytes(b"sched" * 10)
    (d / "training_args.bin").write_bytes(b"targs" * 10)
    if state:
        hist = [{"loss": loss, "step": step}] if loss is not None else []
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": hist}))
    if link:
        link_last(out, step)
    return d


def make_megatron(out: Path, step: int, rank: int = 8, safetensors: bool = True, shards: bool = True,
                  iter_file: bool = True, config: bool = True) -> Path:
    d = out / f"checkpoint-{step}"
    it = d / f"iter_{step:07d}"
    it.mkdir(parents=True)
    (d / "args.json").write_text("{}")
    (it / "common.pt").write_bytes(b"common" * 20)
    if shards:
        (it / "__0_0.distcp").write_bytes(os.urandom(4096))
        (it / ".metadata").write_bytes(b"meta")
    if safetensors:
        write_adapter(d / "adapter_model.safetensors", rank, step=step)   # distinct per save: not a stale copy
        if config:
            adapter_config(d, rank)
    if iter_file:
        (d / ck.ITER_FILE).write_text(str(step))
    return d


def make_merged(out: Path, step: int, drop_shard: bool = False) -> Path:
    d = out / f"checkpoint-{step}-merged"
    d.mkdir(parents=True)
    wmap = {}
    for k in (1, 2):
        shard = f"model-0000{k}-of-00002.safetensors"
        t = {f"model.layers.{k}.mlp.weight": np.ones((8, 8), np.float32)}
        wmap.update({n: shard for n in t})
        if not (drop_shard and k == 2):
            save_file(t, str(d / shard))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (d / "config.json").write_text("{}")
    (d / ck.ITER_FILE).write_text(str(step))
    return d
