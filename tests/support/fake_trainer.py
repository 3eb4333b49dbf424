#!/usr/bin/env python3
"""A stand-in for `megatron sft` / `swift sft` (ms-swift 4.6) that can fail the way a GPU job fails.

Run as `fake_trainer.py sft <ms-swift flags>`. It prints the real progress formats (stdout dict per log
step, `[INFO:swift]` + tqdm on stderr), appends `<output_dir>/logging.jsonl`, writes checkpoints in the
real order with the real completeness markers, resumes from them, and injects faults with the real crash
texts (tests/support/crash_texts.py). No handler for SIGTERM: it dies of it (-15) like the real trainer
(FAKE_TERM_S: some seconds later).

Environment:
  FAKE_BACKEND      megatron | swift (default: swift if --max_steps is given, else megatron)
  FAKE_STARTUP_S    delay before step 1 (model loading), default 0.05
  FAKE_STEP_S       seconds per step, default 0.01
  FAKE_SHARD_MB     megatron: MiB of optimizer state per rank shard (__R_0.distcp), default 0 (a few bytes):
                    checkpoints of a real size for retention and full-disk tests
  FAKE_FAULTS       comma list of <class>@<step> (CrashClass values). A fault fires when the trainer is
                    about to run that step; step 0 = start-up, which every launch goes through (also a
                    resumed one); any other step fires only when > the resume step. disk_full@N strikes
                    during the first checkpoint save at a step >= N; nan_loss@N makes loss and grad_norm
                    nan from step N on (training goes on); nccl_timeout_hang see FAKE_HANG_MODE.
  FAKE_STATE        JSON file recording fired faults: each fault fires once across launches (unset: every time)
  FAKE_NPROC        ranks shown in crash logs (default NPROC_PER_NODE, else 8); 1 = no torchrun output
  MASTER_PORT       port named by port_in_use (default 29500)
  FAKE_HANG_MODE    silent (default: stop logging, sleep until killed) | watchdog (after FAKE_HANG_S,
                    default 0, print the NCCL watchdog timeout and die of SIGABRT)
  FAKE_LAUNCHER     worker (default: die like the failing rank, crash_texts.exit_status) | torchrun (exit
                    like torchrun/the `megatron` wrapper: 1 for every worker failure, host_oom_killed too)
  FAKE_EXIT_AFTER_STEP=N   stop cleanly (exit 0, end-of-run records) after step N although N < max
  FAKE_STALE_SAVE=N the save at step N writes the previous checkpoint's weight bytes (adapter safetensors,
                    mcore shards) under the new step, as an async writer's cached copy did (NeMo-RL #3312);
                    with FAKE_STATE once across launches (the relaunch's save of step N is a fresh one)
  FAKE_NONFINITE_SAVE=N the save at step N writes an Inf into one tensor of its adapter safetensors (a save made
                    after the weights overflowed, the loss not logged NaN yet); with FAKE_STATE once across launches
  FAKE_LATE_LOG=N   the log record of step N (stdout dict and logging.jsonl) comes after that step's save (and after
                    FAKE_HOLD's wait at N), as a block-buffered stdout shows it (print to a file, no PYTHONUNBUFFERED)
  FAKE_HOLD=N:PATH[,N:PATH]  after step N (its log and save) the trainer waits, silent, until PATH exists (at most
                    600 s): a test's handle between a save and the next step; no wait once PATH exists (a relaunch
                    goes on)
  FAKE_TERM_S=S     on SIGTERM the trainer goes on for S seconds (finishing a save, a rank stuck in a collective)
                    before it dies of it; default 0: dies at once
  FAKE_REJECT_FLAGS comma list of flag names; if one is passed: `ValueError: remaining_argv: [...]`, exit 1
  FAKE_CURVE        a real curve (tests/fixtures/curves/*.json): step k logs the loss and grad norm of its k-th
                    point (a point without a grad norm logs none), as the run it was transcribed from logged them
  FAKE_FORMAT       dict (default: ms-swift 4.x, the stdout dict and logging.jsonl) | pipe (megatron backend: what
                    ms-swift 3.x's Megatron backend prints, release/3.12 trainers/base.py training_log: Megatron-LM's
                    pipe-separated iteration line plus memory/elapsed/remaining, a validation block before each save,
                    Megatron-LM's `saving checkpoint at iteration N ... in torch_dist format` / `successfully saved
                    checkpoint from iteration N ...` around each save, no tqdm bar, `[after training is done]` at the
                    end; and no <output_dir>/logging.jsonl: 3.x writes it under its versioned save dir
                    (<save>/vN-<time>/), which is not the directory the supervisor watches, and plain Megatron-LM
                    writes none)
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import pickle
import resource
import signal
import struct
import sys
import threading
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_texts  # noqa: E402
from orchestrator.types import CrashClass  # noqa: E402

T0 = time.time()
env = os.environ.get


def info(msg: str) -> None:
    sys.stderr.write(f"[INFO:swift] {msg}\n")
    sys.stderr.flush()


def parse_argv(argv: list[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """ms-swift style: `--key v1 v2`, `--key=v`, bare `--flag` = true. Returns (by name, raw tokens by name)."""
    opts: dict[str, list[str]] = {}
    raw: dict[str, list[str]] = {}
    key = None
    for tok in argv:
        if tok.startswith("--"):
            name, eq, val = tok[2:].partition("=")
            key = name.replace("-", "_")
            opts[key], raw[key] = ([val] if eq else []), [tok]
        elif key is not None:
            opts[key].append(tok)
            raw[key].append(tok)
    return opts, raw


def format_time(seconds: float) -> str:  # swift.utils.format_time
    total = round(seconds)
    d, h, m, s = total // 86400, total % 86400 // 3600, total % 3600 // 60, total % 60
    return f"{d}d {h}h {m}m {s}s" if d else f"{h}h {m}m {s}s" if h else f"{m}m {s}s" if m else f"{s}s"


def torch_save(path: str, obj) -> None:
    """A file torch.load(weights_only=True) reads: the zip layout of torch.save with a protocol-2 pickle."""
    name = "archive"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/data.pkl", pickle.dumps(obj, protocol=2))
        z.writestr(f"{name}/byteorder", "little")
        z.writestr(f"{name}/version", "3\n")
        z.writestr(f"{name}/.data/serialization_id", "0" * 40)


def save_safetensors(path: str, tensors: dict[str, tuple[tuple[int, ...], list[float]]]) -> None:
    try:
        from safetensors.numpy import save_file  # imports numpy; ImportError when either is missing
        import numpy as np
    except ImportError:  # hand-written format: u64 header length, JSON header, raw little-endian data
        header: dict = {"__metadata__": {"format": "pt"}}
        data = bytearray()
        for k in sorted(tensors):
            shape, vals = tensors[k]
            b = struct.pack(f"<{len(vals)}f", *vals)
            header[k] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(data), len(data) + len(b)]}
            data += b
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + data)
        return
    save_file({k: np.asarray(v, dtype=np.float32).reshape(s) for k, (s, v) in tensors.items()}, path,
              metadata={"format": "pt"})


class Fake:
    HIDDEN = 64

    def __init__(self, argv: list[str]):
        if argv and argv[0] == "sft":
            argv = argv[1:]
        self.argv = argv
        self.opts, self.raw = parse_argv(argv)
        o = self.opts
        self.backend = env("FAKE_BACKEND") or ("swift" if "max_steps" in o and "train_iters" not in o else "megatron")
        self.meg = self.backend == "megatron"
        self.out = os.path.abspath(self.get("output_dir", "output"))
        self.max = self.geti("train_iters" if self.meg else "max_steps", 30)
        self.save_steps = max(1, self.geti("save_steps", 500))
        self.logging_steps = max(1, self.geti("logging_steps", 5))
        self.rank = self.geti("lora_rank", 8)
        self.alpha = float(self.get("lora_alpha", 32))
        self.targets = o.get("target_modules") or ["all-linear"]
        self.safetensors = self.getb("save_safetensors", True)
        self.merge = self.getb("merge_lora", self.safetensors) and self.meg   # megatron default: = save_safetensors
        self.no_save_optim = self.getb("no_save_optim", False)
        self.lr_max = float(self.get("lr" if self.meg else "learning_rate", 1e-4))
        self.nranks = int(env("FAKE_NPROC") or env("NPROC_PER_NODE") or 8)
        self.port = int(env("MASTER_PORT") or 29500)
        self.step_s = float(env("FAKE_STEP_S", "0.01"))
        self.shard_bytes = int(float(env("FAKE_SHARD_MB", "0")) * (1 << 20))
        self.exit_after = int(env("FAKE_EXIT_AFTER_STEP") or 0)
        self.stale_save = int(env("FAKE_STALE_SAVE") or 0)
        self.nonfinite_save = int(env("FAKE_NONFINITE_SAVE") or 0)
        self.late_log = int(env("FAKE_LATE_LOG") or 0)
        self.holds = {int(n): path for n, _, path in
                      (h.partition(":") for h in (env("FAKE_HOLD") or "").split(",") if h.strip())}
        self.term_s = float(env("FAKE_TERM_S") or 0)
        self.terming = self.expired = False   # FAKE_TERM_S: a SIGTERM came; its term_s are over
        self.torchrun_exit = env("FAKE_LAUNCHER", "worker") == "torchrun"
        fmt = env("FAKE_FORMAT", "dict")
        if fmt not in ("dict", "pipe") or (fmt == "pipe" and not self.meg):
            sys.exit(f"fake_trainer: FAKE_FORMAT={fmt!r}: dict, or pipe with the megatron backend")
        self.pipe = fmt == "pipe"
        self.gbs = self.geti("global_batch_size", 16)
        self.logged_at = (0, T0)                  # (step, time) of the last log line: Megatron's per-iteration time
        self.faults = []
        for item in filter(None, (s.strip() for s in env("FAKE_FAULTS", "").split(","))):
            cls, _, step = item.partition("@")
            self.faults.append((CrashClass(cls.strip()), int(step or 0)))
        self.state_path = env("FAKE_STATE")
        self.fired: list[str] = []
        if self.state_path and os.path.exists(self.state_path):
            with open(self.state_path) as f:
                self.fired = json.load(f).get("fired", [])
        self.start = 0
        self.nan = False
        self.last_ckpt = None
        self.log_history: list[dict] = []
        self.losses: list[float] = []
        self.curve: list[dict] = []
        if env("FAKE_CURVE"):
            with open(env("FAKE_CURVE")) as f:
                self.curve = json.load(f)["points"]

    # --- flags ---------------------------------------------------------------------------------------
    def get(self, key, default=None):
        v = self.opts.get(key)
        return v[0] if v else default

    def geti(self, key, default):
        return int(self.get(key, default))

    def getb(self, key, default):
        if key not in self.opts:
            return default
        return (self.opts[key] or ["true"])[0].lower() in ("true", "1", "yes")

    # --- deterministic training curve: f(step) only, or a real one (FAKE_CURVE) -----------------------------
    def loss(self, k):
        if self.curve and k <= len(self.curve):
            return self.curve[k - 1].get("loss")
        return float("nan") if self.nan else 2.0 * math.exp(-k / 50) + 0.5 + 0.02 * math.sin(1.7 * k)

    def grad_norm(self, k):
        if self.curve and k <= len(self.curve):
            return self.curve[k - 1].get("grad_norm")
        return float("nan") if self.nan else 0.3 + 0.5 * math.exp(-k / 20) + 0.05 * abs(math.sin(0.37 * k))

    def lr(self, k): return self.lr_max * 0.5 * (1 + math.cos(math.pi * k / max(self.max, 1)))

    # --- faults ------------------------------------------------------------------------------------------
    def due(self, step: int, kinds=None, at_least=False):
        """The first unfired fault for this step (step 0 faults: any launch; others: only after the resume step)."""
        for cls, s in self.faults:
            hit = (s <= step if at_least else s == step) and (s == 0 or s > self.start)
            if hit and (kinds is None or cls in kinds) and self.once(f"{cls}@{s}"):
                return cls
        return None

    def once(self, key: str) -> bool:
        """Tells whether the fault `key` fires now: not fired before (with FAKE_STATE: in any launch), recorded."""
        if key in self.fired:
            return False
        self.fired.append(key)
        if self.state_path:
            tmp = f"{self.state_path}.tmp"
            with open(tmp, "w") as f:
                json.dump({"fired": self.fired}, f)
            os.replace(tmp, self.state_path)
        return True

    def crash(self, cls: CrashClass, step: int, **kw) -> None:
        sys.stdout.flush()
        if cls is CrashClass.NCCL_TIMEOUT_HANG and env("FAKE_HANG_MODE", "silent") != "watchdog":
            while True:  # a hung collective: alive, silent, until someone kills it
                time.sleep(3600)
        if cls is CrashClass.NCCL_TIMEOUT_HANG:
            time.sleep(float(env("FAKE_HANG_S", "0")))
        if cls is not CrashClass.HOST_OOM_KILLED or self.torchrun_exit:
            sys.stderr.write(crash_texts.text(cls, step=step, nranks=self.nranks, port=self.port, backend=self.backend,
                                              pid=os.getpid(), max_steps=self.max, output_dir=self.out, **kw))
        sys.stderr.flush()
        status = crash_texts.exit_status(cls)
        if self.torchrun_exit:
            status = 1
        if isinstance(status, signal.Signals):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if status is not signal.SIGKILL:
                signal.signal(status, signal.SIG_DFL)
            os.kill(os.getpid(), status)
            time.sleep(5)
        sys.exit(status)

    # --- run -------------------------------------------------------------------------------------------
    def run(self) -> None:
        if self.term_s > 0:
            signal.signal(signal.SIGTERM, self.on_sigterm)
        reject = {f.strip().lstrip("-").replace("-", "_") for f in env("FAKE_REJECT_FLAGS", "").split(",") if f.strip()}
        bad = [tok for k in self.raw if k in reject for tok in self.raw[k]]
        if bad:
            self.crash(CrashClass.OTHER, 0, remaining_argv=bad)
        for cls in (CrashClass.OTHER, CrashClass.PORT_IN_USE):  # argument parsing / torchrun rendezvous: at once
            if self.due(0, kinds={cls}):
                self.crash(cls, 0)
        info(f"Start time of running main: {dt.datetime.now():%Y-%m-%d %H:%M:%S.%f}")
        info("swift.__version__: 4.6.0")
        kind = "MegatronSftArguments" if self.meg else "SftArguments"
        info(f"args: {kind}(output_dir='{self.out}', {'train_iters' if self.meg else 'max_steps'}={self.max}, "
             f"save_steps={self.save_steps}, logging_steps={self.logging_steps}, lora_rank={self.rank}, ...)")
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "args.json"), "w") as f:
            json.dump({"output_dir": self.out, "backend": self.backend, "argv": self.argv, "max_steps": self.max,
                       "save_steps": self.save_steps, "logging_steps": self.logging_steps, "lora_rank": self.rank,
                       "lora_alpha": self.alpha, "target_modules": self.targets}, f, indent=2)
        time.sleep(float(env("FAKE_STARTUP_S", "0.05")))
        self.resume()
        cls = self.due(0, kinds=set(CrashClass) - {CrashClass.DISK_FULL, CrashClass.NAN_LOSS})
        if cls:
            self.crash(cls, 0)
        self.nan = bool(self.due(0, kinds={CrashClass.NAN_LOSS}))
        info(f"logging_path: {self.jsonl}" if self.meg else f"The logging file will be saved in: {self.jsonl}")
        self.t_train = time.time()
        self.logged_at = (self.start, self.t_train)
        for step in range(self.start + 1, self.max + 1):
            cls = self.due(step, kinds=set(CrashClass) - {CrashClass.DISK_FULL})
            if cls is CrashClass.NAN_LOSS:
                self.nan = True
            elif cls:
                self.crash(cls, step)
            time.sleep(self.step_s)
            if not self.pipe:
                self.bar(step)
            logged = step == 1 or step % self.logging_steps == 0
            if logged and step != self.late_log:
                self.log(step)
            if self.pipe and step % self.save_steps == 0:
                self.validation(step)
            if step % self.save_steps == 0 or step == self.max:
                self.save(step)
            if step in self.holds:
                self.hold(self.holds[step])
            if logged and step == self.late_log:
                self.log(step)
            if step == self.exit_after:
                break
        self.finish(step if self.max > self.start else self.start)

    @staticmethod
    def hold(path: str) -> None:
        deadline = time.time() + 600
        while not os.path.exists(path) and time.time() < deadline:
            time.sleep(0.02)

    def on_sigterm(self, signum, _frame) -> None:
        """Goes on after SIGTERM; term_s after the first one a timer sends it again, and then it dies of it. (Only
        the main thread may reset the handler; a second SIGTERM can run this while the first still does.)"""
        if self.expired:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif not self.terming:
            self.terming = True
            threading.Thread(target=self.die_later, args=(signum,), daemon=True).start()

    def die_later(self, signum: int) -> None:
        time.sleep(self.term_s)
        self.expired = True
        os.kill(os.getpid(), signum)

    @property
    def jsonl(self):
        return os.path.join(self.out, "logging.jsonl")

    def append_jsonl(self, rec: dict) -> None:
        if self.pipe:
            return
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")

    def resume(self) -> None:
        if self.meg:
            ckpt = self.get("mcore_adapter") or self.get("adapters")
            if not ckpt:
                return
            info(f"checkpoint_dir: {ckpt}")
            tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
            if not os.path.exists(tracker):
                if self.get("mcore_adapter"):
                    sys.stderr.write(f"FileNotFoundError: [Errno 2] No such file or directory: '{tracker}'\n")
                    sys.exit(1)
                return
            if not self.getb("finetune", True):  # --finetune false: restore the iteration
                with open(tracker) as f:
                    self.start = int(f.read().strip())
        else:
            ckpt = self.get("resume_from_checkpoint")
            if not ckpt:
                return
            path = os.path.join(ckpt, "trainer_state.json")
            if not os.path.exists(path):
                sys.stderr.write(f"ValueError: Can't find a valid checkpoint at {ckpt}\n")
                sys.exit(1)
            with open(path) as f:
                st = json.load(f)
            self.start, self.log_history = st["global_step"], st.get("log_history", [])

    def bar(self, step: int) -> None:
        n, el = step - self.start, time.time() - self.t_train
        rate = n / el if el > 0 else 0.0
        pct = 100 * step // self.max
        full, part = divmod(step * 10 * 8 // self.max, 8)
        cells = ("█" * full + (" ▏▎▍▌▋▊▉"[part] if full < 10 else ""))[:10].ljust(10)
        speed = f"{rate:.2f}it/s" if rate >= 1 or rate == 0 else f"{1 / rate:.2f}s/it"
        sys.stderr.write(f"\rTrain: {pct:3d}%|{cells}| {step}/{self.max} "
                         f"[{_mmss(el)}<{_mmss((self.max - step) / rate if rate else 0)}, {speed}]")
        sys.stderr.flush()

    def log(self, step: int) -> None:
        el = time.time() - self.t_train
        speed = el / (step - self.start)
        loss, gn, lr = self.loss(step), self.grad_norm(step), self.lr(step)
        self.losses.append(loss)
        mem = round(70.12 + 0.1 * min(step, 10), 2)
        if self.pipe:
            print(self.pipe_line(step, loss, gn, lr, mem, el, speed), flush=True)
            return
        if self.meg:
            logs = {"loss": loss, "grad_norm": gn, "learning_rate": lr,
                    "load_balancing_loss": 1.0 + 0.03 * math.exp(-step / 40) + 0.001 * math.sin(step),
                    "iteration": f"{step}/{self.max}", "elapsed_time": format_time(el),
                    "remaining_time": format_time((self.max - step) * speed), "memory(GiB)": mem,
                    "train_speed(s/it)": round(speed, 6)}
            logs = {k: round(v, 8) if isinstance(v, float) else v for k, v in logs.items()}
            print(str(logs), flush=True)
        else:
            logs = {"loss": loss, "grad_norm": gn, "learning_rate": lr, "token_acc": 0.42 + 0.001 * step,
                    "epoch": step / self.max, "global_step/max_steps": f"{step}/{self.max}",
                    "elapsed_time": format_time(el), "remaining_time": format_time((self.max - step) * speed),
                    "memory(GiB)": mem, "train_speed(s/it)": speed}
            logs = {k: round(v, 8) if isinstance(v, float) else v for k, v in logs.items()}
            print(str({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in logs.items()}), flush=True)
            self.log_history.append({**logs, "step": step})
        self.append_jsonl(logs)

    def pipe_line(self, step: int, loss: float, gn: float, lr: float, mem: float, el: float, speed: float) -> str:
        """ms-swift 3.x megatron's training_log line (release/3.12 swift/megatron/trainers/base.py)."""
        last_step, last_t = self.logged_at
        now = time.time()
        self.logged_at = (step, now)
        per_iter = (now - last_t) / max(step - last_step, 1)
        lbl = 1.0 + 0.03 * math.exp(-step / 40) + 0.001 * math.sin(step)
        s = f" [{dt.datetime.now():%Y-%m-%d %H:%M:%S}]"
        s += " iteration {:8d}/{:8d} |".format(step, self.max)
        s += " consumed samples: {:12d} |".format(step * self.gbs)
        s += " elapsed time per iteration (ms): {:.1f} |".format(per_iter * 1000.0)
        s += (f" memory(GiB): {mem} | elapsed time: {format_time(el)} |"
              f" remaining time: {format_time((self.max - step) * speed)} |")
        s += f" learning rate: {lr:.6E} |"
        s += f" global batch size: {self.gbs:5d} |"
        s += " {}: {:.6E} |".format("lm loss", loss) + " {}: {:.6E} |".format("load_balancing_loss", lbl)
        s += f" loss scale: {1.0:.1f} |"
        s += f" grad norm: {gn:.3f} |"
        s += " number of skipped iterations: {:3d} |".format(0)
        s += " number of nan iterations: {:3d} |".format(0)  # bf16: nothing skipped, the NaN shows in the loss
        return s

    def validation(self, step: int) -> None:
        """Megatron-LM's evaluate_and_print_results block (eval_interval = save_interval in ms-swift 3.x)."""
        loss = self.loss(step) + 0.05
        line = " validation loss at iteration {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ".format(
            step, loss, math.exp(min(loss, 700)))
        print("-" * (len(line) + 1), line, "-" * (len(line) + 1), sep="\n", flush=True)

    # --- checkpoints ---------------------------------------------------------------------------------------
    def modules(self) -> list[str]:
        if self.targets != ["all-linear"]:
            return self.targets
        return ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"] if self.meg else ["q_proj", "k_proj", "v_proj", "o_proj"]

    def lora_tensors(self, step: int, prefix: str) -> dict:
        mods = self.modules()
        out, r, h = {}, self.rank, self.HIDDEN
        for layer in range(2):
            for i, m in enumerate(mods):
                blk = "self_attn" if ("proj" in m and "fc" not in m) or "qkv" in m else "mlp"
                for ab, shape in (("lora_A", (r, h)), ("lora_B", (h, r))):
                    seed = layer * 31 + i * 7 + (ab == "lora_B") * 3 + step * 0.01
                    out[f"{prefix}.layers.{layer}.{blk}.{m}.{ab}.weight"] = (
                        shape, [0.01 * math.sin(seed + 0.1 * j) for j in range(r * h)])
        return out

    def adapter(self, d: str, step: int) -> None:
        save_safetensors(os.path.join(d, "adapter_model.safetensors"), self.lora_tensors(step, "base_model.model.model"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                       "lora_dropout": 0.05, "bias": "none", "use_rslora": False, "inference_mode": True,
                       "target_modules": self.modules(),
                       "modules_to_save": None, "base_model_name_or_path": self.get("model", "")}, f, indent=2)

    def disk_full(self, path: str, step: int) -> None:
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04" + b"\0" * 4096)  # a torch zip cut short by ENOSPC
        self.crash(CrashClass.DISK_FULL, step)

    def save(self, step: int) -> None:
        d = os.path.join(self.out, f"checkpoint-{step}")
        os.makedirs(d, exist_ok=True)
        full = self.due(step, kinds={CrashClass.DISK_FULL}, at_least=True)
        with open(os.path.join(self.out, "args.json")) as f:
            args_json = f.read()
        with open(os.path.join(d, "args.json"), "w") as f:
            f.write(args_json)
        if self.meg:
            if self.pipe:  # ms-swift 3.x points Megatron-LM's args.save at checkpoint-N (trainers/base.py)
                print(f"saving checkpoint at iteration {step:7d} to {d} in torch_dist format", flush=True)
            it = os.path.join(d, f"iter_{step:07d}")
            os.makedirs(it, exist_ok=True)
            if full and self.no_save_optim:
                self.disk_full(os.path.join(it, "common.pt"), step)
            torch_save(os.path.join(it, "common.pt"), {"iteration": step, "consumed_train_samples": step * 16,
                                                         "checkpoint_version": 3.0})
            if not self.no_save_optim:
                if full:
                    self.disk_full(os.path.join(it, "__0_0.distcp"), step)
                for r in range(self.nranks):
                    with open(os.path.join(it, f"__{r}_0.distcp"), "wb") as f:
                        f.write(struct.pack("<Q", step) * 64)
                        for _ in range(0, self.shard_bytes, 1 << 20):
                            f.write(os.urandom(min(1 << 20, self.shard_bytes)))
                with open(os.path.join(it, ".metadata"), "wb") as f:
                    f.write(pickle.dumps({"iteration": step, "world_size": self.nranks}))
                with open(os.path.join(it, "metadata.json"), "w") as f:
                    json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                               "common_backend": "torch", "common_backend_version": 1}, f)
            with open(os.path.join(d, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(step))
            if self.pipe:
                print(f"  successfully saved checkpoint from iteration {step:7d} to {d} [ t 1/1, p 1/1 ]", flush=True)
            else:
                info(f"Successfully saved Megatron model weights in `{d}`.")
            if self.safetensors:
                self.adapter(d, step)
                info(f"Successfully saved `safetensors` model weights in `{d}`.")
            if self.merge:
                md = f"{d}-merged"
                os.makedirs(os.path.join(md, f"iter_{step:07d}"), exist_ok=True)
                for name in ("latest_checkpointed_iteration.txt", "args.json", f"iter_{step:07d}/common.pt"):
                    with open(os.path.join(d, name), "rb") as src, open(os.path.join(md, name), "wb") as dst:
                        dst.write(src.read())
                h = self.HIDDEN
                save_safetensors(os.path.join(md, "model.safetensors"), {
                    f"model.layers.{i}.self_attn.q_proj.weight": ((h, h), [math.cos(step + j) * 0.02 for j in range(h * h)])
                    for i in range(2)})
                with open(os.path.join(md, "config.json"), "w") as f:
                    json.dump({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": h, "num_hidden_layers": 2}, f)
                info(f"Successfully saved `safetensors` model weights in `{md}`.")
        else:
            self.adapter(d, step)
            with open(os.path.join(d, "additional_config.json"), "w") as f:
                json.dump({"lora_dtype": None, "lorap_lr_ratio": None, "lorap_emb_lr": 1e-06}, f)
            if full:
                self.disk_full(os.path.join(d, "optimizer.pt"), step)
            torch_save(os.path.join(d, "optimizer.pt"), {"state": {}, "param_groups": [{"lr": self.lr(step)}]})
            torch_save(os.path.join(d, "scheduler.pt"), {"last_epoch": step, "_last_lr": [self.lr(step)]})
            torch_save(os.path.join(d, "rng_state.pth"), {"python": step, "numpy": step, "cpu": step})
            with open(os.path.join(d, "trainer_state.json"), "w") as f:
                json.dump({"global_step": step, "max_steps": self.max, "save_steps": self.save_steps,
                           "logging_steps": self.logging_steps, "epoch": step / self.max, "best_metric": None,
                           "best_model_checkpoint": None, "log_history": self.log_history}, f, indent=2)
            torch_save(os.path.join(d, "training_args.bin"), {"output_dir": self.out})
            info(f"Saving model checkpoint to {d}")
        if step == self.stale_save and self.once(f"stale_save@{step}"):
            self.stale_copy(d, step)
        if step == self.nonfinite_save and self.once(f"nonfinite_save@{step}"):
            self.poison(os.path.join(d, "adapter_model.safetensors"))
        link = os.path.join(self.out, "last-checkpoint")
        if os.path.lexists(f"{link}.tmp"):
            os.remove(f"{link}.tmp")
        os.symlink(os.path.basename(d), f"{link}.tmp")
        os.replace(f"{link}.tmp", link)
        self.last_ckpt = d

    def stale_copy(self, d: str, step: int) -> None:
        """Overwrite this save's weight files with the previous checkpoint's bytes (its shards' iter_ directory
        renamed to this step's): complete and verifiable, but stale."""
        steps = [int(n[11:]) for n in os.listdir(self.out) if n.startswith("checkpoint-") and n[11:].isdigit()]
        prev = max((s for s in steps if s < step), default=None)
        if prev is None:
            return
        pd = os.path.join(self.out, f"checkpoint-{prev}")
        for root, _dirs, files in os.walk(pd):
            for fn in files:
                if fn.endswith((".safetensors", ".distcp")):
                    rel = os.path.relpath(os.path.join(root, fn), pd).replace(f"iter_{prev:07d}", f"iter_{step:07d}")
                    with open(os.path.join(root, fn), "rb") as src, open(os.path.join(d, rel), "wb") as dst:
                        dst.write(src.read())

    @staticmethod
    def poison(path: str) -> None:
        """Sets the first float32 of the file's first tensor (by data offset) to +Inf, in place."""
        with open(path, "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            first = min((v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"))
            f.seek(8 + n + first)
            f.write(struct.pack("<f", math.inf))

    def finish(self, step: int) -> None:
        if self.pipe:  # Megatron-LM's end of train(); ms-swift 3.x megatron logs no last_model_checkpoint
            print(f"[after training is done] datetime: {dt.datetime.now():%Y-%m-%d %H:%M:%S} ", flush=True)
            info(f"End time of running main: {dt.datetime.now():%Y-%m-%d %H:%M:%S.%f}")
            sys.exit(0)
        sys.stderr.write("\n")
        if not self.meg:
            el = time.time() - self.t_train
            n = max(step - self.start, 1)
            done = [x for x in self.losses if x is not None and not math.isnan(x)]
            summary = {"train_runtime": round(el, 4), "train_samples_per_second": round(16 * n / el, 3),
                       "train_steps_per_second": round(n / el, 3),
                       "train_loss": round(sum(done) / len(done), 8) if done else float("nan"),
                       "epoch": step / self.max, "global_step/max_steps": f"{step}/{self.max}",
                       "elapsed_time": format_time(el), "remaining_time": format_time(0),
                       "memory(GiB)": 71.12, "train_speed(s/it)": round(el / n, 6)}
            print(str({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in summary.items()}), flush=True)
            self.append_jsonl(summary)
        info(f"last_model_checkpoint: {self.last_ckpt}")
        info("best_model_checkpoint: None")
        final = {"last_model_checkpoint": self.last_ckpt, "best_model_checkpoint": None, "best_metric": None}
        if not self.meg:
            final.update({"global_step": step, "log_history": self.log_history, "memory": 71.12})
        self.append_jsonl(final)
        info(f"End time of running main: {dt.datetime.now():%Y-%m-%d %H:%M:%S.%f}")
        sys.exit(0)


def _mmss(s: float) -> str:
    return f"{int(s) // 60:02d}:{int(s) % 60:02d}"


if __name__ == "__main__":
    Fake(sys.argv[1:]).run()
