#!/usr/bin/env python3
"""An entrypoint wrapper that makes a resume load wrong weights although the checkpoint verifies, as the field's
resume-path bug did ("appeared to load but the weights were incorrectly reassembled"). For the real-swift e2e
of issue 23 (item 2): `run.entrypoint = [python, tests/support/perturb_resume.py, --, swift]`.

When the trainer's argv resumes from a checkpoint (`--resume_from_checkpoint`, `--mcore_adapter`, `--adapters`),
the wrapper copies that checkpoint to a scratch directory, perturbs the LoRA tensors of the copy's
adapter_model.safetensors and runs the trainer on the copy. The checkpoint on disk is untouched: it still
verifies, and only the loss after the resume shows that the weights are wrong.

The CPU demo's tiny model sits near the uniform loss (ln vocab), where no LoRA perturbation moves the loss
(measured: noise 0.3 and 3.0 on the demo's adapter changed the redone losses by < 1 %, the grad norm 1.4 ->
0.04); PERTURB_TARGET=model perturbs the base model's copy instead (`--model`): scaled output embeddings make
the logits confidently wrong, and the loss jumps.

Environment:
  PERTURB_TARGET      adapter (default) | model: the resumed checkpoint's LoRA tensors, or the base model's
                      tensors named by PERTURB_MODEL_PATTERN (a copy of --model)
  PERTURB_MODEL_PATTERN  regex on tensor names for PERTURB_TARGET=model (default: lm_head|embed_tokens)
  PERTURB_SCALE       the tensors are multiplied by this (default 8.0; 0 zeroes LoRA: the base model)
  PERTURB_NOISE       plus Gaussian noise of this standard deviation (default 0.0)
  PERTURB_STEPS       comma list of checkpoint steps to perturb (default: every resume); a relaunch from
                      another checkpoint then loads the right weights
  PERTURB_SCRATCH     where the copies go (default: a temporary directory)
  PERTURB_LOG         a file each perturbed resume is appended to ("<step> <original> <copy>")
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

RESUME_FLAGS = ("--resume_from_checkpoint", "--mcore_adapter", "--adapters")
ADAPTER = "adapter_model.safetensors"


def resume_arg(argv: list[str]) -> int | None:
    """The index of the resume path in the trainer's argv (the value after a resume flag), if any."""
    for i, a in enumerate(argv[:-1]):
        if a in RESUME_FLAGS:
            return i + 1
    return None


def checkpoint_step(path: str) -> int | None:
    m = re.search(r"checkpoint-(\d+)", Path(path).name)
    return int(m.group(1)) if m else None


def perturb_tensors(path: Path, scale: float, noise: float, pattern: str = "lora_", seed: int = 0) -> int:
    """Rewrite the safetensors file at `path` with the tensors whose name matches `pattern` scaled (and noised);
    returns how many."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    changed = 0
    for name, t in tensors.items():
        if re.search(pattern, name) and t.is_floating_point():
            out = t.float() * scale
            if noise:
                out = out + noise * torch.randn(t.shape, generator=gen)
            tensors[name] = out.to(t.dtype).contiguous()
            changed += 1
    save_file(tensors, str(path), metadata={"format": "pt"})
    return changed


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: perturb_resume.py -- TRAINER [ARGS...]", file=sys.stderr)
        return 2
    trainer = argv[argv.index("--") + 1:]
    i = resume_arg(trainer)
    wanted = {int(s) for s in os.environ.get("PERTURB_STEPS", "").split(",") if s.strip()}
    step = checkpoint_step(trainer[i]) if i is not None else None
    model = "--model" in trainer[:-1] and os.environ.get("PERTURB_TARGET", "adapter") == "model"
    if i is not None and (not wanted or step in wanted):
        if model:
            i = trainer.index("--model") + 1
        original = Path(trainer[i])
        scratch = Path(os.environ.get("PERTURB_SCRATCH") or tempfile.mkdtemp(prefix="perturb-resume-"))
        copy = scratch / original.name
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(original, copy, symlinks=True)
        scale, noise = float(os.environ.get("PERTURB_SCALE", "8.0")), float(os.environ.get("PERTURB_NOISE", "0.0"))
        pattern = os.environ.get("PERTURB_MODEL_PATTERN", "lm_head|embed_tokens") if model else "lora_"
        changed = sum(perturb_tensors(f, scale, noise, pattern) for f in copy.rglob("*.safetensors")
                      if model or f.name == ADAPTER)
        if not changed:
            print(f"perturb_resume: no tensor matching {pattern!r} in {original}: nothing perturbed", file=sys.stderr)
        trainer[i] = str(copy)
        if os.environ.get("PERTURB_LOG"):
            with open(os.environ["PERTURB_LOG"], "a") as f:
                f.write(f"{step} {original} {copy}\n")
    os.execvp(trainer[0], trainer)  # the trainer takes this process over: signals and exit status are its own


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
