"""Parse rendered commands with ms-swift's own argument classes, as `megatron sft|export` / `swift sft|export` do.

Run as a subprocess by tests/test_swift_parse.py (the stubs below must not leak into other tests).
stdin: JSON list of {"argv": [...], "env": {...}}; stdout (last line): JSON list of results.

How ms-swift parses (4.6.0): swift.pipelines.base.SwiftPipeline._parse_args calls
swift.utils.parse_args(args_class, argv) -> (args, remaining_argv) and raises
ValueError('remaining_argv: ...') when anything is left over. HfArgumentParser instantiates the
dataclass, so its __post_init__ checks run as part of parsing.

Stubbed on this CPU machine, and only these:
- `transformer_engine` and `triton` while mcore_bridge is imported (it imports them at import time;
  neither installs without CUDA), and megatron-core's TE placeholder classes that are None without TE;
- `megatron sft`'s distributed set-up (needs CUDA/NCCL): sft_args.init_process_group is a no-op and
  megatron_args.initialize_megatron only sets rank 0 and world_size = NPROC_PER_NODE of the command.
Everything else, including MegatronArguments.__post_init__'s checks, runs for real.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import traceback
from unittest import mock


class _GpuOnlyModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    prefixes = ("transformer_engine", "triton")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.prefixes:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name)
        m.__path__, m.__spec__, m.__name__ = [], spec, spec.name
        return m

    def exec_module(self, module):
        pass


def import_megatron_args():
    import megatron.core  # noqa: F401  (imported before the stubs: it must see no TransformerEngine)
    import megatron.core.extensions.transformer_engine as te_ext
    import peft.tuners.lora  # noqa: F401  (peft probes for TE with find_spec)
    import torch

    for name, v in list(vars(te_ext).items()):
        if v is None and name.startswith(("TE", "Fp8")):
            setattr(te_ext, name, type(name, (torch.nn.Module,), {}))
    finder = _GpuOnlyModules()
    sys.meta_path.insert(0, finder)
    try:
        import mcore_bridge
        import mcore_bridge.model  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k.split(".")[0] in finder.prefixes]:
            del sys.modules[k]
    from swift.megatron.arguments import MegatronExportArguments, MegatronSftArguments, megatron_args, sft_args
    return {"sft": MegatronSftArguments, "export": MegatronExportArguments}, megatron_args, sft_args


def parse(args_class, argv: list[str]) -> dict:
    from swift.utils import parse_args

    try:
        args, remaining = parse_args(args_class, argv)
    except BaseException as e:  # argparse exits with SystemExit; __post_init__ raises ValueError & co
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    keep = ("tuner_type", "finetune", "mcore_adapter", "adapters", "merge_lora", "no_save_optim", "num_train_epochs",
            "expert_model_parallel_size", "world_size", "data_parallel_size", "num_microbatches", "lora_rank",
            "accumulate_allreduce_grads_in_fp32", "padding_free", "output_dir", "resume_from_checkpoint",
            "resume_only_model", "gradient_accumulation_steps", "to_hf", "exist_ok", "model", "ckpt_dir")
    parsed = {k: getattr(args, k) for k in keep if hasattr(args, k)}
    return {"remaining": remaining,
            "parsed": {k: v for k, v in parsed.items() if isinstance(v, (str, int, float, bool, list, type(None)))}}


def main() -> None:
    commands = json.load(sys.stdin)
    results = []
    megatron = None
    for cmd in commands:
        argv, env = cmd["argv"], cmd["env"]
        os.environ.update(env)
        sub = next(i for i, w in enumerate(argv) if w in ("sft", "export"))
        if argv[sub - 1].endswith("megatron"):
            if megatron is None:
                megatron = import_megatron_args()
            classes, margs, sargs = megatron
            cls = classes[argv[sub]]
            world = int(env.get("NPROC_PER_NODE", "1"))

            def fake_initialize(a, world=world):
                a.rank, a.world_size = 0, world

            with mock.patch.object(sargs, "init_process_group", lambda *a, **k: None), \
                    mock.patch.object(margs, "initialize_megatron", fake_initialize):
                results.append(parse(cls, argv[sub + 1:]))
        else:
            from swift.arguments import ExportArguments, SftArguments
            results.append(parse(SftArguments if argv[sub] == "sft" else ExportArguments, argv[sub + 1:]))
        for k in env:
            os.environ.pop(k, None)
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
