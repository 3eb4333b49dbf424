"""tests/support/perturb_resume.py, the e2e helper for a resume from wrong weights: it runs the trainer on a perturbed
copy of the checkpoint it resumes from and leaves the checkpoint itself as it was."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

HELPER = Path(__file__).parent / "support" / "perturb_resume.py"
ECHO = "import json, sys; print(json.dumps(sys.argv[1:]))"


def checkpoint(tmp_path: Path, step: int) -> Path:
    d = tmp_path / "out" / f"checkpoint-{step}"
    d.mkdir(parents=True)
    safetensors_torch.save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(2, 4),
                                 "base_model.model.layers.0.q_proj.lora_B.weight": torch.full((4, 2), 0.5),
                                 "other.bias": torch.ones(3)}, str(d / "adapter_model.safetensors"))
    (d / "trainer_state.json").write_text("{}")
    return d


def run(args: list[str], env: dict) -> list[str]:
    r = subprocess.run([sys.executable, str(HELPER), "--", sys.executable, "-c", ECHO, *args], env=env,
                       capture_output=True, text=True, timeout=120, check=True)
    return json.loads(r.stdout)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_a_resume_runs_on_a_perturbed_copy_and_the_checkpoint_stays_as_it_was(tmp_path):
    ckpt = checkpoint(tmp_path, 20)
    before = sha(ckpt / "adapter_model.safetensors")
    log = tmp_path / "perturbed.log"
    env = {"PATH": "/usr/bin:/bin", "PERTURB_SCRATCH": str(tmp_path / "scratch"), "PERTURB_LOG": str(log),
           "PERTURB_SCALE": "3"}
    argv = run(["sft", "--resume_from_checkpoint", str(ckpt), "--max_steps", "40"], env)
    copy = Path(argv[2])
    assert argv[:2] == ["sft", "--resume_from_checkpoint"] and argv[3:] == ["--max_steps", "40"]
    assert copy != ckpt and copy.name == "checkpoint-20" and (copy / "trainer_state.json").is_file()
    assert sha(ckpt / "adapter_model.safetensors") == before
    t = safetensors_torch.load_file(str(copy / "adapter_model.safetensors"))
    assert torch.equal(t["base_model.model.layers.0.q_proj.lora_B.weight"], torch.full((4, 2), 1.5))
    assert torch.equal(t["other.bias"], torch.ones(3))  # only LoRA tensors
    assert log.read_text().split()[0] == "20"


@pytest.mark.parametrize("args,steps,perturbed", [
    (["sft", "--max_steps", "40"], "", False),                                      # fresh: nothing to perturb
    (["sft", "--mcore_adapter", "{ckpt}", "--finetune", "false"], "", True),        # megatron resume
    (["sft", "--adapters", "{ckpt}"], "20", True),                                  # the step asked for
    (["sft", "--resume_from_checkpoint", "{ckpt}"], "10,30", False),                # another step: untouched
])
def test_which_launches_are_perturbed(tmp_path, args, steps, perturbed):
    ckpt = checkpoint(tmp_path, 20)
    env = {"PATH": "/usr/bin:/bin", "PERTURB_SCRATCH": str(tmp_path / "scratch"), "PERTURB_STEPS": steps}
    argv = run([a.format(ckpt=ckpt) for a in args], env)
    assert (str(ckpt) not in argv and any("scratch" in a for a in argv)) is perturbed


def test_the_base_model_can_be_perturbed_instead(tmp_path):
    ckpt = checkpoint(tmp_path, 20)
    model = tmp_path / "tiny-moe"
    model.mkdir()
    safetensors_torch.save_file({"lm_head.weight": torch.ones(3, 2), "model.layers.0.mlp.weight": torch.ones(2)},
                                str(model / "model.safetensors"))
    before = sha(model / "model.safetensors")
    env = {"PATH": "/usr/bin:/bin", "PERTURB_SCRATCH": str(tmp_path / "scratch"), "PERTURB_TARGET": "model",
           "PERTURB_SCALE": "20"}
    argv = run(["sft", "--model", str(model), "--resume_from_checkpoint", str(ckpt)], env)
    copy = Path(argv[argv.index("--model") + 1])
    assert copy != model and argv[argv.index("--resume_from_checkpoint") + 1] == str(ckpt)
    t = safetensors_torch.load_file(str(copy / "model.safetensors"))
    assert torch.equal(t["lm_head.weight"], torch.full((3, 2), 20.0))
    assert torch.equal(t["model.layers.0.mlp.weight"], torch.ones(2))
    assert sha(model / "model.safetensors") == before
    # a fresh launch (no resume) trains on the real model
    assert run(["sft", "--model", str(model)], env)[2] == str(model)
