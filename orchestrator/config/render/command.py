"""(recipe, resume point, port) -> Command for either backend. Pure."""
from __future__ import annotations

from orchestrator.config.recipe import Recipe
from orchestrator.config.render.argv import flags
from orchestrator.types import Command, Resume

# Env every launch gets. Offline: no hub calls at run time. Unbuffered: progress lines reach the
# log as they are printed.
BASE_ENV = {
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}
# PCIe nodes without NVLink/InfiniBand: peer-to-peer over PCIe and IB probing hang or corrupt.
NCCL_PRESETS = {
    "none": {},
    "pcie": {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"},
}


def environment(recipe: Recipe, port: int, extra: dict[str, str]) -> dict[str, str]:
    env = {**BASE_ENV, **extra, **NCCL_PRESETS[recipe.env.nccl_preset]}
    if recipe.parallel.nproc_per_node > 1 or recipe.run.backend == "megatron" or recipe.parallel.nnodes > 1:
        # Setting NPROC_PER_NODE makes the ms-swift wrapper use torchrun; megatron always needs it.
        env |= {"NPROC_PER_NODE": str(recipe.parallel.nproc_per_node), "MASTER_PORT": str(port),
                "MASTER_ADDR": "127.0.0.1"}
    if recipe.parallel.nnodes > 1:  # MASTER_ADDR (the first node) and NODE_RANK come at launch (launch/slurm.py)
        env["NNODES"] = str(recipe.parallel.nnodes)
    return env | recipe.env.vars  # the recipe has the last word


def _backend(recipe: Recipe):
    from orchestrator.config.render import megatron, swift
    return megatron if recipe.run.backend == "megatron" else swift


def duplicated_extra_args(recipe: Recipe) -> list[str]:
    """extra_args keys that the recipe already renders (fresh or resumed): the last one would win silently."""
    backend = _backend(recipe)
    rendered = {w[2:] for resume in (None, Resume("ckpt", 1)) for w in backend.arguments(recipe, resume, 1)
                if w.startswith("--")}
    return sorted(k for k in recipe.extra_args if k in rendered)


def rendering_problems(recipe: Recipe) -> list[tuple[tuple[str, ...], str]]:
    """A `recipe.load` check: [(keys, message)] for extra_args the recipe already renders."""
    return [((f"extra_args.{k}",), f"--{k} is already rendered from the recipe; set the recipe key instead "
                                   f"(see `orchestrator plan`)") for k in duplicated_extra_args(recipe)]


def render_command(recipe: Recipe, resume: Resume | None, port: int, save_steps: int | None = None) -> Command:
    """`save_steps`: this launch's checkpoint interval (interval.py's choice); required for "auto"."""
    backend = _backend(recipe)
    exe = list(recipe.run.entrypoint or [backend.EXECUTABLE])
    argv = exe + ["sft"] + backend.arguments(recipe, resume, save_steps) + flags(recipe.extra_args.items())
    return Command(argv=tuple(argv), env=environment(recipe, port, backend.ENV))
