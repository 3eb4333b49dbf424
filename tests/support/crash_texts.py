"""Realistic crash logs for the fake trainer (tests/support/fake_trainer.py), one per CrashClass.

`text(cls, step=, nranks=, port=)` returns what an 8-GPU `megatron sft` / `swift sft` job prints on stderr
(the workers' `[rankN]:`-prefixed output interleaved with the torchrun agent's) when the fault hits;
`exit_status(cls)` is how the failing process ends (an exit code, or a signal it dies of).

Modelled on /work/shared/crash-logs/*.log and on the strings and line numbers of the installed
ms-swift 4.6.0, transformers 5.x and torch 2.13 (`c10d` / `torch.distributed.elastic` messages),
megatron-core, mcore-bridge and fla 0.6.0. Rank 3 (or the last rank, with fewer ranks) hits the root
cause; the other ranks cascade (NCCL watchdog aborts, or torchrun's SIGTERM).
"""
from __future__ import annotations

import datetime as _dt
import signal
import socket

from orchestrator.types import CrashClass

SP = "/usr/local/lib/python3.12/dist-packages"
PYTHON = "/usr/bin/python3"
NCCL_VERSION = "2.21.5"
OOM_TAIL = ("If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
CUDA_TAIL = ["Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html "
             "for more information.",
             "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
             "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
             "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."]
ELASTIC = "torch/distributed/elastic"

# --- traceback frames: (path under site-packages, line, function, source line) -------------------------
_HEAD = {
    "megatron": [("swift/cli/_megatron/sft.py", 7, "<module>", "megatron_sft_main()"),
                 ("swift/megatron/pipelines/train/sft.py", 93, "megatron_sft_main", "return MegatronSft(args).main()"),
                 ("swift/pipelines/base.py", 52, "main", "result = self.run()")],
    "swift": [("swift/cli/sft.py", 20, "<module>", "sft_main()"),
              ("swift/pipelines/train/sft.py", 345, "sft_main", "return SwiftSft(args).main()"),
              ("swift/pipelines/base.py", 52, "main", "result = self.run()")],
}
_TRAIN = {  # from main() down to one training step
    "megatron": [("swift/megatron/pipelines/train/sft.py", 68, "run", "trainer.train(train_dataset, val_dataset)"),
                 ("swift/megatron/trainers/base.py", 795, "train", "self.run_train_step(train_data_iterator, val_data_iterator)"),
                 ("swift/megatron/trainers/base.py", 737, "run_train_step",
                  "metrics, grad_norm, update_successful = self.train_step(train_data_iterator)"),
                 ("swift/megatron/trainers/base.py", 1003, "train_step", "metrics = forward_backward_func(")],
    "swift": [("swift/pipelines/train/sft.py", 189, "run", "return self.train(trainer)"),
              ("swift/pipelines/train/sft.py", 263, "train", "trainer.train(resume_checkpoint)"),
              ("swift/trainers/mixin.py", 1029, "train", "res = super().train(*args, **kwargs)"),
              ("transformers/trainer.py", 1562, "train", "return inner_training_loop("),
              ("transformers/trainer.py", 1892, "_inner_training_loop",
               "tr_loss_step = self.training_step(model, inputs, num_items_in_batch)")],
}
_BACKWARD = {
    "megatron": [("megatron/core/pipeline_parallel/schedules.py", 636, "forward_backward_no_pipelining",
                  "backward_step("),
                 ("megatron/core/pipeline_parallel/schedules.py", 469, "backward_step",
                  "torch.autograd.backward(output_tensor[0], grad_tensors=output_tensor_grad[0])")],
    "swift": [("transformers/trainer.py", 2101, "training_step", "self.accelerator.backward(loss, **kwargs)"),
              ("accelerate/accelerator.py", 2861, "backward", "loss.backward(**kwargs)"),
              ("torch/_tensor.py", 623, "backward", "torch.autograd.backward(")],
}
_AUTOGRAD = [("torch/autograd/__init__.py", 395, "backward", "_engine_run_backward("),
             ("torch/autograd/graph.py", 979, "_engine_run_backward",
              "return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass"),
             ("torch/autograd/function.py", 325, "apply", "return user_fn(self, *args)")]
_FLA = [("fla/utils/decorators.py", 152, "wrapper", "return fn(*processed_args, **processed_kwargs)"),
        ("torch/amp/autocast_mode.py", 566, "decorate_bwd", "return bwd(*args, **kwargs)"),
        ("fla/ops/gated_delta_rule/chunk.py", 362, "backward",
         "dq, dk, dv, db, dg, dh0, dA_log, ddt_bias = chunk_gated_delta_rule_bwd("),
        ("fla/ops/gated_delta_rule/chunk.py", 172, "chunk_gated_delta_rule_bwd", "dv = chunk_bwd_dv_local("),
        ("fla/backends.py", 200, "wrapper", "return default_function(*args, **kwargs)"),
        ("fla/ops/common/chunk_o.py", 684, "chunk_bwd_dv_local", "dv = torch.empty_like(do)")]
_MODULE = [("torch/nn/modules/module.py", 1778, "_wrapped_call_impl", "return self._call_impl(*args, **kwargs)"),
           ("torch/nn/modules/module.py", 1789, "_call_impl", "return forward_call(*args, **kwargs)")]
_FORWARD = {
    "megatron": [("megatron/core/pipeline_parallel/schedules.py", 614, "forward_backward_no_pipelining",
                  "output_tensor, num_tokens = forward_step("),
                 ("megatron/core/pipeline_parallel/schedules.py", 417, "forward_step",
                  "output_tensor, loss_func = forward_step_func(data_iterator, model)"),
                 ("swift/megatron/trainers/trainer.py", 132, "forward_step", "output_tensor = model(**data)"),
                 *_MODULE,
                 ("megatron/core/distributed/data_parallel_base.py", 22, "forward", "return self.module(*inputs, **kwargs)"),
                 *_MODULE,
                 ("megatron/core/transformer/module.py", 489, "forward", "outputs = self.module(*inputs, **kwargs)"),
                 *_MODULE,
                 ("mcore_bridge/model/gpt_model.py", 388, "forward", "loss = self.compute_language_model_loss(labels, logits)"),
                 ("megatron/core/models/common/language_module/language_module.py", 163, "compute_language_model_loss",
                  "loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)"),
                 ("megatron/core/tensor_parallel/cross_entropy.py", 232, "vocab_parallel_cross_entropy",
                  "return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)"),
                 ("torch/autograd/function.py", 581, "apply", "return super().apply(*args, **kwargs)  # type: ignore[misc]"),
                 ("megatron/core/tensor_parallel/cross_entropy.py", 137, "forward",
                  "VocabParallelCrossEntropy.calculate_predicted_logits("),
                 ("megatron/core/tensor_parallel/cross_entropy.py", 52, "calculate_predicted_logits",
                  "vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)")],
    "swift": [("transformers/trainer.py", 2065, "training_step",
               "loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)"),
              ("swift/trainers/seq2seq_trainer.py", 168, "compute_loss", "outputs = model(**inputs)"),
              *_MODULE,
              ("peft/peft_model.py", 1923, "forward", "return self.base_model("),
              *_MODULE,
              ("peft/tuners/tuners_utils.py", 311, "forward", "return self.model.forward(*args, **kwargs)"),
              ("transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py", 1726, "forward",
               "loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)"),
              ("transformers/loss/loss_utils.py", 67, "ForCausalLMLoss", "logits = logits.float()")],
}
_LOAD = {  # model loading at start-up
    "megatron": [("swift/megatron/pipelines/train/sft.py", 66, "run", "trainer = self.prepare_trainer()"),
                 ("swift/megatron/pipelines/train/sft.py", 34, "prepare_trainer",
                  "return MegatronTrainer(self.args, self.template)"),
                 ("swift/megatron/trainers/base.py", 79, "__init__", "self.prepare_model()"),
                 ("swift/megatron/trainers/base.py", 207, "prepare_model", "self.bridge.load_weights(models, args.model_dir)"),
                 ("mcore_bridge/bridge/gpt_bridge.py", 1547, "load_weights",
                  "list(self._convert(mg_models, hf_state_dict, '', to_mcore=True, tqdm_desc='Loading: '))"),
                 ("mcore_bridge/bridge/gpt_bridge.py", 1490, "_convert",
                  "res = self._set_layer_state(mg_layer, hf_state_dict, f'{hf_prefix}layers.', layer_idx, to_mcore)"),
                 ("mcore_bridge/bridge/gpt_bridge.py", 1211, "_set_moe_state",
                  "self._set_mlp_state(mg_experts, hf_state_dict, f'{hf_prefix}experts.', layer_idx, to_mcore)"),
                 ("mcore_bridge/bridge/gpt_bridge.py", 418, "_set_weight",
                  "hf_weight = hf_weight.to(device=mg_param.device, dtype=mg_param.dtype)")],
    "swift": [("swift/pipelines/train/sft.py", 30, "__init__", "self._prepare_model_tokenizer()"),
              ("swift/pipelines/train/sft.py", 61, "_prepare_model_tokenizer",
               "self.model, self.processor = args.get_model_processor()"),
              ("swift/model/register.py", 694, "get_model_processor", "model = model_loader.load()"),
              ("transformers/modeling_utils.py", 4111, "from_pretrained", "loading_info, disk_offload_index = cls._load_pretrained_model("),
              ("transformers/modeling_utils.py", 4227, "_load_pretrained_model",
               "loading_info, disk_offload_index = convert_and_load_state_dict_in_model("),
              ("transformers/core_model_loading.py", 1042, "convert_and_load_state_dict_in_model",
               "param = param.to(device=param_device, dtype=dtype)")],
}
_SAVE = {
    "megatron": [("swift/megatron/pipelines/train/sft.py", 68, "run", "trainer.train(train_dataset, val_dataset)"),
                 ("swift/megatron/trainers/base.py", 795, "train", "self.run_train_step(train_data_iterator, val_data_iterator)"),
                 ("swift/megatron/trainers/base.py", 778, "run_train_step", "self.save_checkpoint()"),
                 ("swift/megatron/trainers/base.py", 843, "save_checkpoint", "async_deferred = save_mcore_checkpoint("),
                 ("swift/megatron/utils/megatron_lm_utils.py", 357, "save_mcore_checkpoint",
                  "async_save_request = dist_checkpointing.save("),
                 ("megatron/core/dist_checkpointing/serialization.py", 436, "save",
                  "sharded_strategy.save(sharded_state_dict, checkpoint_dir)"),
                 ("megatron/core/dist_checkpointing/strategies/fully_parallel.py", 96, "save",
                  "return self.base_strategy.save(sharded_state_dict, checkpoint_dir)"),
                 ("megatron/core/dist_checkpointing/strategies/base.py", 228, "save", "async_calls.maybe_finalize_async_calls(blocking=True)"),
                 ("megatron/core/dist_checkpointing/strategies/async_utils.py", 567, "maybe_finalize_async_calls",
                  "finalize_fn()"),
                 ("megatron/core/dist_checkpointing/strategies/torch.py", 682, "finalize_fn",
                  "save_state_dict_async_finalize(*save_state_dict_ret)"),
                 ("megatron/core/dist_checkpointing/strategies/state_dict_saver.py", 236, "save_state_dict_async_finalize",
                  "write_results = storage_writer.retrieve_write_results()"),
                 ("megatron/core/dist_checkpointing/strategies/filesystem_async.py", 471, "retrieve_write_results",
                  "raise RuntimeError(f'Worker failure: {write_results_or_exc}') from write_results_or_exc")],
    "swift": [("swift/pipelines/train/sft.py", 189, "run", "return self.train(trainer)"),
              ("swift/pipelines/train/sft.py", 263, "train", "trainer.train(resume_checkpoint)"),
              ("swift/trainers/mixin.py", 1029, "train", "res = super().train(*args, **kwargs)"),
              ("transformers/trainer.py", 1562, "train", "return inner_training_loop("),
              ("transformers/trainer.py", 1933, "_inner_training_loop", "self._maybe_log_save_evaluate("),
              ("transformers/trainer.py", 2260, "_maybe_log_save_evaluate", "self._save_checkpoint(model, trial)"),
              ("swift/trainers/mixin.py", 613, "_save_checkpoint", "result = super()._save_checkpoint(*args, **kwargs)"),
              ("transformers/trainer.py", 3358, "_save_checkpoint", "self._save_optimizer_and_scheduler(output_dir)"),
              ("transformers/trainer.py", 3530, "_save_optimizer_and_scheduler",
               "torch.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))")],
}
_TORCHRUN = [("torch/distributed/run.py", 1032, "<module>", "main()"),
             (f"{ELASTIC}/multiprocessing/errors/__init__.py", 367, "wrapper", "return f(*args, **kwargs)"),
             ("torch/distributed/run.py", 1028, "main", "run(args)"),
             ("torch/distributed/run.py", 1019, "run", "elastic_launch("),
             ("torch/distributed/launcher/api.py", 194, "__call__", "return launch_agent(")]
_RUNPY = ['  File "<frozen runpy>", line 198, in _run_module_as_main', '  File "<frozen runpy>", line 88, in _run_code']
_METRICS = (f"{ELASTIC}/metrics/api.py", 134, "wrapper", "result = f(*args, **kwargs)")
_RDZV = [("torch/distributed/launcher/api.py", 374, "launch_agent", "result = agent.run()"), _METRICS,
         (f"{ELASTIC}/agent/server/api.py", 745, "run", "result = self._invoke_run(role)"),
         (f"{ELASTIC}/agent/server/api.py", 916, "_invoke_run", "self._initialize_workers(self._worker_group)"), _METRICS,
         (f"{ELASTIC}/agent/server/api.py", 713, "_initialize_workers", "self._rendezvous(worker_group)"), _METRICS,
         (f"{ELASTIC}/agent/server/api.py", 528, "_rendezvous", "rdzv_info = spec.rdzv_handler.next_rendezvous()"),
         (f"{ELASTIC}/rendezvous/static_tcp_rendezvous.py", 67, "next_rendezvous",
          "self._store = TCPStore(  # type: ignore[call-arg]")]
_WATCHDOG_FRAMES = [
    "c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f3a8e96c1b8 in {sp}/torch/lib/libc10.so)",
    "c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, std::ratio<1l, 1000l> > >)"
    " + 0x2b4 (0x7f3a3c9fec74 in {sp}/torch/lib/libtorch_cuda.so)",
    "c10d::ProcessGroupNCCL::Watchdog::runLoop() + 0x890 (0x7f3a3ca007d0 in {sp}/torch/lib/libtorch_cuda.so)",
    "c10d::ProcessGroupNCCL::Watchdog::run() + 0x14d (0x7f3a3ca0170d in {sp}/torch/lib/libtorch_cuda.so)",
    "<unknown function> + 0xecdb4 (0x7f3a8e4ecdb4 in /lib/x86_64-linux-gnu/libstdc++.so.6)",
    "<unknown function> + 0x9caa4 (0x7f3a9a29caa4 in /lib/x86_64-linux-gnu/libc.so.6)",
    "<unknown function> + 0x129c6c (0x7f3a9a329c6c in /lib/x86_64-linux-gnu/libc.so.6)",
]


def _frames(frames) -> list[str]:
    out = []
    for path, line, func, code in frames:
        out += [f'  File "{path if path.startswith("<") else f"{SP}/{path}"}", line {line}, in {func}', f"    {code}"]
    return out


def _tb(frames, exc: list[str]) -> list[str]:
    return ["Traceback (most recent call last):", *_frames(frames), *exc]


def _pre(rank: int | None, lines: list[str]) -> list[str]:
    """Python output of a torchrun worker carries a `[rankN]: ` prefix on every line."""
    return lines if rank is None else [f"[rank{rank}]: {ln}" if ln else f"[rank{rank}]:" for ln in lines]


class _Clock:
    """Timestamps in the formats the c10 logger (`[E1206 18:44:12.715298746 File.cpp:N]`) and torchrun's
    Python logger (`W1120 22:03:44.004000 9921 path.py:N]`) use, advancing a little per line."""

    def __init__(self, when: _dt.datetime | None):
        self.t = when or _dt.datetime.now()

    def tick(self, ms: float = 3.0) -> _dt.datetime:
        self.t += _dt.timedelta(milliseconds=ms)
        return self.t

    def c10(self, level: str, where: str, rank: int | None = None) -> str:
        t = self.tick()
        prefix = "" if rank is None else f"[rank{rank}]:"
        return f"{prefix}[{level}{t.month}{t.day:02d} {t:%H:%M:%S}.{t.microsecond:06d}{rank or 0:03d} {where}]"

    def py(self, level: str, pid: int, where: str) -> str:
        t = self.tick(40)
        return f"{level}{t:%m%d %H:%M:%S}.{t.microsecond:06d} {pid} {where}]"


def _box(entry: str, failures: list[tuple[int, int, int]], clock: _Clock, host: str) -> list[str]:
    """torchrun's ChildFailedError summary; failures = [(rank, exitcode, pid)], the first is the root cause."""
    def one(idx, rank, code, pid):
        sig = f" ({signal.Signals(-code).name})" if code < 0 else ""
        msg = (f"Signal {-code} ({signal.Signals(-code).name}) received by PID {pid}" if code < 0
               else "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
        return [f"[{idx}]:", f"  time      : {clock.t:%Y-%m-%d_%H:%M:%S}", f"  host      : {host}",
                f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code} (pid: {pid}) {sig}".rstrip(),
                "  error_file: <N/A>", f"  traceback : {msg}"]
    others = [ln for i, f in enumerate(failures[1:], 1) for ln in one(i, *f)] or ["  <NO_OTHER_FAILURES>"]
    return ["=" * 60, f"{entry} FAILED", "-" * 60, "Failures:", *others, "-" * 60,
            "Root Cause (first observed failure):", *one(0, *failures[0]), "=" * 60]


def _agent_end(backend: str, nranks: int, root: int, code: int, pids: dict[int, int], clock: _Clock,
               aborted: dict[int, int] | None = None) -> list[str]:
    """torchrun after a worker died: SIGTERM the live ranks, report, raise ChildFailedError (torchrun exits 1)."""
    aborted = aborted or {}
    agent = pids["agent"]
    api = f"{ELASTIC}/multiprocessing/api.py"
    out = [clock.py("W", agent, f"{api}:1029") + f" Sending process {pids[r]} closing signal SIGTERM"
           for r in range(nranks) if r != root and r not in aborted]
    out.append(clock.py("E", agent, f"{api}:1003") + f" failed (exitcode: {code}) local_rank: {root} "
               f"(pid: {pids[root]}) of binary: {PYTHON}")
    entry = f"{SP}/swift/cli/_megatron/sft.py" if backend == "megatron" else f"{SP}/swift/cli/sft.py"
    fails = [(root, code, pids[root])] + [(r, c, pids[r]) for r, c in sorted(aborted.items())]
    tb = ["Traceback (most recent call last):", *_RUNPY, *_frames(_TORCHRUN), *_frames(
        [("torch/distributed/launcher/api.py", 383, "launch_agent", "raise ChildFailedError(")])]
    return out + tb + [f"{ELASTIC.replace('/', '.')}.multiprocessing.errors.ChildFailedError: "] + _box(
        entry, fails, clock, socket.gethostname())


def _oom(gib: str, gpu: int, free: str, procs: list[tuple[int, float]], alloc: float, reserved: float) -> str:
    ps = " ".join(f"Process {p} has {g:.2f} GiB memory in use." for p, g in procs)
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {gib}. GPU {gpu} has a total capacity of "
            f"139.81 GiB of which {free} is free. {ps} Of the allocated memory {alloc:.2f} GiB is allocated by PyTorch, "
            f"and {reserved:.2f} GiB is reserved by PyTorch but unallocated. {OOM_TAIL}")


def _nan_line(step: int, max_steps: int, backend: str) -> str:
    if backend == "swift":
        return str({"loss": "nan", "grad_norm": "nan", "learning_rate": "9.1e-05", "token_acc": "0.4375",
                    "epoch": f"{step / max_steps:.4g}", "global_step/max_steps": f"{step}/{max_steps}",
                    "elapsed_time": "1m 2s", "remaining_time": "3m 5s", "memory(GiB)": "70.12", "train_speed(s/it)": "8.9"})
    return str({"loss": float("nan"), "grad_norm": float("nan"), "learning_rate": 9.1e-05,
                "load_balancing_loss": 1.0213, "iteration": f"{step}/{max_steps}", "elapsed_time": "1m 2s",
                "remaining_time": "3m 5s", "memory(GiB)": 70.12, "train_speed(s/it)": 8.9})


def text(cls: CrashClass | str, *, step: int, nranks: int, port: int, backend: str = "megatron",
         pid: int | None = None, max_steps: int | None = None, output_dir: str = "/data/runs/out",
         remaining_argv: list[str] | None = None, when: _dt.datetime | None = None) -> str:
    """The combined stderr of the job when `cls` strikes about to run `step` (0 = start-up).

    nranks == 1 means a single process without torchrun: no `[rankN]:` prefixes, no agent output.
    `pid` is the failing worker's pid (torchrun's own pid is taken as pid - 1 - rank).
    """
    cls = CrashClass(cls)
    nranks = max(1, nranks)
    root = min(3, nranks - 1)
    dist = nranks > 1
    base = (pid - 1 - root) if pid else 9921
    pids: dict = {"agent": base, **{r: base + 1 + r for r in range(nranks)}}
    clock = _Clock(when)
    R = root if dist else None
    gpu = root if dist else 0
    head = _HEAD[backend]
    out: list[str] = []

    def die(code: int, aborted=None):
        if dist:
            out.extend(_agent_end(backend, nranks, root, code, pids, clock, aborted))

    def destroy_warning():
        if dist:
            out.append(clock.c10("W", "ProcessGroupNCCL.cpp:1553", root) + " Warning: WARNING: destroy_process_group() "
                       "was not called before program exit, which can leak resources. For more info, please see "
                       "https://pytorch.org/docs/stable/distributed.html#shutdown (function operator())")

    if cls is CrashClass.COLD_START_OOM:
        exc = _oom("2.00 GiB", gpu, "1.12 GiB", [(81234, 77.46), (pids[root], 61.20)], 58.74, 1.63)
        out += _pre(R, _tb((head if backend == "megatron" else head[:2]) + _LOAD[backend], [exc]))
        destroy_warning()
        die(1)
    elif cls is CrashClass.FLA_BACKWARD_OOM:
        exc = _oom("266.00 MiB", gpu, "121.06 MiB", [(pids[root], 139.68)], 131.40, 6.52)
        out += _pre(R, _tb(head + _TRAIN[backend] + _BACKWARD[backend] + _AUTOGRAD + _FLA, [exc]))
        destroy_warning()
        die(1)
    elif cls is CrashClass.OOM_DURING_TRAINING:
        exc = _oom("9.28 GiB", gpu, "5.37 GiB", [(pids[root], 134.43)], 121.88, 10.04)
        frames = head + _TRAIN[backend] + _FORWARD[backend]
        out += _pre(R, _tb(frames, [exc]))
        destroy_warning()
        die(1)
    elif cls is CrashClass.NCCL_ERROR:
        grad_sync = [("megatron/core/distributed/finalize_model_grads.py", 424, "finalize_model_grads",
                      "model_chunk.finish_grad_sync()"),
                     ("megatron/core/distributed/distributed_data_parallel.py", 512, "finish_grad_sync",
                      "bucket_group.finish_grad_sync()"),
                     ("megatron/core/distributed/param_and_grad_buffer.py", 493, "finish_grad_sync",
                      "self.start_grad_sync()"),
                     ("megatron/core/distributed/param_and_grad_buffer.py", 431, "start_grad_sync",
                      "dist_reduce_scatter_func("),
                     ("torch/distributed/c10d_logger.py", 83, "wrapper", "return func(*args, **kwargs)"),
                     ("torch/distributed/distributed_c10d.py", 4512, "reduce_scatter_tensor",
                      "work = group._reduce_scatter_base(output, input, opts)")]
        if backend == "swift":  # DDP: the gradient all-reduce runs in autograd hooks
            grad_sync = _BACKWARD["swift"] + _AUTOGRAD[:2]
        exc = [f"torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
               f"unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version {NCCL_VERSION}",
               "ncclUnhandledCudaError: Call to CUDA function failed.", "Last error:",
               "Cuda failure 1 'invalid argument'"]
        frames = head + _TRAIN[backend]
        if backend == "megatron":
            frames = frames + [("megatron/core/pipeline_parallel/schedules.py", 650, "forward_backward_no_pipelining",
                                "config.finalize_model_grads_func(")]
        out += _pre(R, _tb(frames + grad_sync, exc))
        aborted = {}
        for r in range(nranks) if dist else ():
            if r == root:
                continue
            pg = f"[PG ID 0 PG GUID 0(default_pg) Rank {r}]"
            out += [clock.c10("E", "ProcessGroupNCCL.cpp:2039", r) + f" {pg} Process group watchdog thread terminated "
                    f"with exception: NCCL error: remote process exited or there was a network error, NCCL version {NCCL_VERSION}",
                    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
                    "Last error:", f"socketProgressOpt: Call to recv from 10.0.0.{10 + root}<4{9901 + root}> failed : "
                    "Connection reset by peer",
                    clock.c10("E", "ProcessGroupNCCL.cpp:684", r) + f" [Rank {r}] Some NCCL operations have failed or timed "
                    "out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on "
                    "corrupted/incomplete data.",
                    clock.c10("E", "ProcessGroupNCCL.cpp:698", r) + f" [Rank {r}] To avoid data inconsistency, we are "
                    "taking the entire process down.",
                    "terminate called after throwing an instance of 'c10::DistBackendError'",
                    f"  what():  {pg} Process group watchdog thread terminated with exception: NCCL error: remote process "
                    f"exited or there was a network error, NCCL version {NCCL_VERSION}"]
            aborted[r] = -6
        die(1, aborted)
    elif cls is CrashClass.NCCL_TIMEOUT_HANG:
        seq = 40 * step + 13
        work = (f"WorkNCCL(SeqNum={seq}, OpType=_REDUCE_SCATTER_BASE, NumelIn=544997376, NumelOut=68124672, "
                f"Timeout(ms)=600000)")
        ranks = [root] + [r for r in range(nranks) if r != root]
        for i, r in enumerate(ranks):
            wd = f"[Rank {r}] Watchdog caught collective operation timeout: {work} ran for {600061 + 13 * i} milliseconds before timing out."
            pg = f"[PG ID 1 PG GUID 1 Rank {r}]"
            out += [clock.c10("E", "ProcessGroupNCCL.cpp:632", (r if dist else None)) + " " + wd,
                    clock.c10("E", "ProcessGroupNCCL.cpp:2271", (r if dist else None)) + f" {pg}  failure detected by watchdog at work "
                    f"sequence id: {seq} PG status: last enqueued work: {seq + 2}, last completed work: {seq - 1}",
                    clock.c10("E", "ProcessGroupNCCL.cpp:684", (r if dist else None)) + f" [Rank {r}] Some NCCL operations have failed "
                    "or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on "
                    "corrupted/incomplete data.",
                    clock.c10("E", "ProcessGroupNCCL.cpp:698", (r if dist else None)) + f" [Rank {r}] To avoid data inconsistency, we "
                    "are taking the entire process down.",
                    clock.c10("E", "ProcessGroupNCCL.cpp:2105", (r if dist else None)) + f" {pg} Process group watchdog thread "
                    f"terminated with exception: {wd}"]
            if i == 0:
                out += ["Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:635 "
                        "(most recent call first):", *(f"frame #{k}: {f.format(sp=SP)}" for k, f in enumerate(_WATCHDOG_FRAMES)),
                        ""]
            out += ["terminate called after throwing an instance of 'c10::DistBackendError'",
                    f"  what():  {pg} Process group watchdog thread terminated with exception: {wd}"]
            if not dist:
                break
        die(-6, {r: -6 for r in ranks[1:]})
    elif cls is CrashClass.PORT_IN_USE:
        agent = pids["agent"]
        msg = (f"The server socket has failed to listen on any local network address. port: {port}, useIpv6: false, "
               "code: -98, name: EADDRINUSE, message: address already in use")
        out += [clock.py("W", agent, "torch/distributed/run.py:852") + " ",
                clock.py("W", agent, "torch/distributed/run.py:852") + " *****************************************",
                clock.py("W", agent, "torch/distributed/run.py:852") + " Setting OMP_NUM_THREADS environment variable for "
                "each process to be 1 in default, to avoid your system being overloaded, please further tune the variable "
                "for optimal performance in your application as needed. ",
                clock.py("W", agent, "torch/distributed/run.py:852") + " *****************************************",
                clock.c10("W", "socket.cpp:767") + f" [c10d] The server socket has failed to bind to [::]:{port} "
                "(errno: 98 - Address already in use).",
                clock.c10("W", "socket.cpp:767") + f" [c10d] The server socket has failed to bind to 0.0.0.0:{port} "
                "(errno: 98 - Address already in use).",
                clock.c10("E", "socket.cpp:801") + f" [c10d] {msg}",
                "Traceback (most recent call last):", *_RUNPY, *_frames(_TORCHRUN + _RDZV), f"torch.distributed.DistNetworkError: {msg}"]
    elif cls is CrashClass.HOST_OOM_KILLED:
        die(-9)  # the kernel's SIGKILL leaves no trace in the worker; only torchrun reports it
    elif cls is CrashClass.DISK_FULL:
        if backend == "swift":
            first = _tb([("transformers/trainer.py", 3530, "_save_optimizer_and_scheduler",
                          "torch.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))"),
                         ("torch/serialization.py", 1003, "save", "_save("),
                         ("torch/serialization.py", 1312, "_save", "zip_file.write_record(name, storage, num_bytes)")],
                        ["RuntimeError: [enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing "
                         "file data/3: file write failed"])
            second = _tb(head + _SAVE["swift"] + [("torch/serialization.py", 1002, "save",
                                                    "with _open_zipfile_writer(f) as opened_zipfile:"),
                                                   ("torch/serialization.py", 834, "__exit__",
                                                    "self.file_like.write_end_of_file()")],
                         ["RuntimeError: [enforce fail at inline_container.cc:664] . unexpected pos 1855616 vs 1855504"])
            out += _pre(R, first + ["", "During handling of the above exception, another exception occurred:", ""]
                        + second)
        else:
            first = _tb([("megatron/core/dist_checkpointing/strategies/filesystem_async.py", 384, "write_preloaded_data",
                          "local_results.append(_write_item(*transform_list, stream, data, write_item, storage_key))"),
                         ("torch/distributed/checkpoint/filesystem.py", 377, "_write_item",
                          "torch.save(data, stream)"),
                         ("torch/serialization.py", 1003, "save", "_save("),
                         ("torch/serialization.py", 1312, "_save", "zip_file.write_record(name, storage, num_bytes)")],
                        ["RuntimeError: [enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing "
                         "file data/0: file write failed", "",
                         "During handling of the above exception, another exception occurred:", "",
                         "Traceback (most recent call last):",
                         *_frames([("megatron/core/dist_checkpointing/strategies/filesystem_async.py", 392,
                                    "write_preloaded_data", "os.fsync(stream.fileno())")]),
                         "OSError: [Errno 28] No space left on device"])
            second = _tb(head + _SAVE["megatron"], ["RuntimeError: Worker failure: [Errno 28] No space left on device"])
            out += _pre(R, first + ["", "The above exception was the direct cause of the following exception:", ""]
                        + second)
        destroy_warning()
        die(1)
    elif cls is CrashClass.CUDA_FATAL:
        frames = head + _TRAIN[backend] + _FORWARD[backend][:2]
        if backend == "megatron":
            frames = head + _TRAIN[backend] + _FORWARD[backend][:3] + [
                *_MODULE, ("megatron/core/transformer/moe/moe_layer.py", 296, "forward",
                           "dispatched_input, probs = self.dispatch(hidden_states, probs)"),
                ("megatron/core/transformer/moe/token_dispatcher.py", 611, "token_dispatch",
                 "self.tokens_per_expert = self._maybe_dtoh_and_synchronize(")]
        out += _pre(R, _tb(frames, ["torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
                                    *CUDA_TAIL, ""]))
        pg = f"[PG ID 0 PG GUID 0(default_pg) Rank {root}]"
        out += [clock.c10("E", "ProcessGroupNCCL.cpp:2105", R) + f" {pg} Process group watchdog thread terminated with "
                "exception: CUDA error: an illegal memory access was encountered", *CUDA_TAIL, "",
                "Exception raised from c10_cuda_check_implementation at /pytorch/c10/cuda/CUDAException.cpp:44 "
                "(most recent call first):",
                f"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f3a8e96c1b8 in {SP}/torch/lib/libc10.so)",
                "", "terminate called after throwing an instance of 'c10::AcceleratorError'",
                f"  what():  {pg} Process group watchdog thread terminated with exception: CUDA error: an illegal memory "
                "access was encountered", *CUDA_TAIL]
        die(-6)
    elif cls is CrashClass.NAN_LOSS:
        out.append(_nan_line(step, max_steps or max(step, 30), backend))
    else:  # OTHER: the argument parser rejects a flag on every rank
        argv = remaining_argv or ["--bogus", "1"]
        parse = [("swift/megatron/pipelines/train/sft.py" if backend == "megatron" else "swift/pipelines/train/sft.py",
                  41 if backend == "megatron" else 27, "__init__",
                  "super(SwiftSft, self).__init__(args)" if backend == "megatron" else "super().__init__(args)"),
                 ("swift/pipelines/base.py", 18, "__init__", "self.args = self._parse_args(args)"),
                 ("swift/pipelines/base.py", 40, "_parse_args", "raise ValueError(f'remaining_argv: {remaining_argv}')")]
        tb = _tb(head[:2] + parse, [f"ValueError: remaining_argv: {argv!r}"])
        for r in range(nranks) if dist else (None,):
            out += _pre(r, tb)
        die(1, {r: 1 for r in range(nranks) if r != root} if dist else None)
    return "\n".join(out) + ("\n" if out else "")


def exit_status(cls: CrashClass | str) -> int | signal.Signals:
    """How the failing process ends: an exit code, or the signal it dies of (Popen returncode -N)."""
    cls = CrashClass(cls)
    return {CrashClass.NCCL_TIMEOUT_HANG: signal.SIGABRT, CrashClass.CUDA_FATAL: signal.SIGABRT,
            CrashClass.HOST_OOM_KILLED: signal.SIGKILL, CrashClass.NAN_LOSS: 0}.get(cls, 1)
