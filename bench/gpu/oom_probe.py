"""Real CUDA out-of-memory failures for the GPU check, each raised uncaught so that the text is what a
trainer prints (PyTorch's own traceback and message):

    python3 bench/gpu/oom_probe.py startup --gib N        load N GiB of "weights" before any step
    python3 bench/gpu/oom_probe.py training --model DIR   train DIR a few steps (ms-swift's log lines), then
                                                          double the batch until the GPU runs out
    python3 bench/gpu/oom_probe.py fla                    fla's chunked gated delta rule, forward + backward,
                                                          then again with memory capped between the two peaks

Exit 0 with a last line "no OOM: ..." when the GPU did not run out (a finding, not a pass).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

GIB = 1024**3


def startup(gib: float) -> None:
    """Allocate the model's weights at start-up, as a trainer does before its first step."""
    import torch

    free, total = torch.cuda.mem_get_info()
    print(f"start-up: {free / GIB:.2f} GiB free of {total / GIB:.2f} GiB; loading {gib} GiB of weights", flush=True)
    weights = torch.empty(int(gib * GIB), dtype=torch.uint8, device="cuda")
    print(f"no OOM: {weights.numel() / GIB:.2f} GiB allocated with {free / GIB:.2f} GiB free")


def swift_line(step: int, max_steps: int, loss: float, t0: float) -> str:
    """One training log line in ms-swift's format (the classifier reads steps from these)."""
    return str({"loss": f"{loss:.4f}", "grad_norm": "1.0", "learning_rate": "1e-04", "epoch": "0.01",
                "global_step/max_steps": f"{step}/{max_steps}", "percentage": f"{100 * step / max_steps:.2f}%",
                "elapsed_time": f"{time.time() - t0:.0f}s", "remaining_time": "0s"})


def training(model_dir: str, steps: int, seq: int, batch: int, doublings: int) -> None:
    """Train a few steps, then keep doubling the batch: the step that outgrows the GPU raises the OOM."""
    import torch
    from transformers import AutoModelForCausalLM

    # transformers' decorated classmethod reads as unbound to mypy
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab, t0 = model.config.vocab_size, time.time()
    max_steps = steps + doublings
    for step in range(1, max_steps + 1):
        b = batch if step <= steps else batch * 2 ** (step - steps)
        ids = torch.randint(0, vocab, (b, seq), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(swift_line(step, max_steps, float(loss), t0), flush=True)
        print(f"batch {b} x {seq}: peak {torch.cuda.max_memory_allocated() / GIB:.2f} GiB", flush=True)
    print(f"no OOM: {doublings} doublings of the batch fit ({batch * 2 ** doublings} x {seq})")


def fla_inputs(torch, tokens: int, heads: int, dim: int):
    import torch.nn.functional as F

    def leaf(t):
        return t.detach().requires_grad_()

    shape = (1, tokens, heads, dim)
    q = leaf(F.normalize(torch.randn(shape, device="cuda", dtype=torch.float32), p=2, dim=-1).to(torch.bfloat16))
    k = leaf(F.normalize(torch.randn(shape, device="cuda", dtype=torch.float32), p=2, dim=-1).to(torch.bfloat16))
    v = leaf(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
    g = leaf(F.logsigmoid(torch.rand(1, tokens, heads, device="cuda", dtype=torch.float32)))
    beta = leaf(torch.rand(1, tokens, heads, device="cuda", dtype=torch.bfloat16).sigmoid())
    return q, k, v, g, beta


def fla(tokens: int, heads: int, dim: int, tries: int = 6) -> None:
    """Forward + backward once uncapped (peaks measured), then capped between the forward's peak and the
    backward's (a bisection: a forward that runs out raises the cap, a backward that fits lowers it), so
    that the backward runs out inside fla/ops/. Only that OOM is left uncaught."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def forward():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        inputs = fla_inputs(torch, tokens, heads, dim)
        o, _ = chunk_gated_delta_rule(*inputs)
        torch.cuda.synchronize()
        return inputs, o, torch.cuda.max_memory_reserved()

    def backward(inputs, o) -> float:
        o.float().sum().backward()
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(t.grad).all()) for t in inputs)
        print(json.dumps({"tokens": tokens, "bwd_peak_gib": torch.cuda.max_memory_reserved() / GIB,
                          "grads_finite": finite}), flush=True)
        return torch.cuda.max_memory_reserved()

    t0 = time.time()
    inputs, o, fwd = forward()   # compiles the Triton kernels, measures the two peaks
    bwd = backward(inputs, o)
    del inputs, o
    print(f"uncapped forward + backward in {time.time() - t0:.1f} s (kernel compilation included): "
          f"forward peak {fwd / GIB:.3f} GiB, backward peak {bwd / GIB:.3f} GiB", flush=True)
    total, lo, hi = torch.cuda.mem_get_info()[1], 0.0, 1.0
    for _ in range(tries):
        f = (lo + hi) / 2
        cap = fwd + f * (bwd - fwd)
        torch.cuda.set_per_process_memory_fraction(cap / total)
        print(f"capped at {cap / GIB:.3f} GiB ({f:.2f} of the way from the forward's peak to the backward's)", flush=True)
        try:
            inputs, o, _ = forward()
        except torch.OutOfMemoryError:
            print("the forward ran out: raising the cap", flush=True)
            lo = f
            continue
        backward(inputs, o)   # runs out here, uncaught: the trainer's traceback
        del inputs, o
        print("the backward fit: lowering the cap", flush=True)
        hi = f
    print(f"no OOM: no cap between the two peaks made the backward run out in {tries} tries")


def main() -> None:
    ap = argparse.ArgumentParser(prog="oom_probe.py")
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("startup")
    s.add_argument("--gib", type=float, default=8)
    t = sub.add_parser("training")
    t.add_argument("--model", required=True)
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--seq", type=int, default=1024)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--doublings", type=int, default=14)
    f = sub.add_parser("fla")
    f.add_argument("--tokens", type=int, default=32768)
    f.add_argument("--heads", type=int, default=16)
    f.add_argument("--dim", type=int, default=128)
    a = ap.parse_args()
    if a.mode == "startup":
        startup(a.gib)
    elif a.mode == "training":
        training(a.model, a.steps, a.seq, a.batch, a.doublings)
    else:
        fla(a.tokens, a.heads, a.dim)
    sys.exit(0)


if __name__ == "__main__":
    main()
