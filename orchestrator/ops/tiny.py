"""Build the tiny MoE model, its tokenizer and a small chat dataset locally, with no network.

For the CPU demo and the tests: a random Qwen3-MoE (2 layers, 4 experts, ~0.3 M parameters), a
byte-level BPE tokenizer trained on this interpreter's own stdlib, and 300 synthetic chat rows in
ms-swift's `messages` format. Needs the `swift` extra (torch, transformers, tokenizers).
"""
from __future__ import annotations

import glob
import json
import os
import random
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Qwen-style special tokens; the ms-swift `qwen3` template emits <|im_start|>/<|im_end|>
# and <think>...</think> as literal strings, so they must tokenize to single ids.
SPECIAL_TOKENS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<think>', '</think>']

# Simplified Qwen3 chat template (ChatML, optional empty think block when enable_thinking=False).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}")


def corpus_files(limit_bytes=4_000_000):
    stdlib = sysconfig.get_paths()['stdlib']
    files = sorted(glob.glob(os.path.join(stdlib, '*.py')))
    out, total = [], 0
    for f in files:
        try:
            size = os.path.getsize(f)
        except OSError:
            continue
        out.append(f)
        total += size
        if total >= limit_bytes:
            break
    return out


def build_tokenizer(vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    files = corpus_files()
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token='<|im_end|>',
        pad_token='<|endoftext|>',
        additional_special_tokens=['<|im_start|>', '<|im_end|>'],
        model_max_length=2048,
        clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast, files


NAMES = ['alpha', 'beta', 'gamma', 'delta', 'omega', 'sigma', 'kappa', 'lambda']
OPS = [('add', '+', lambda a, b: a + b), ('subtract', '-', lambda a, b: a - b), ('multiply', '*', lambda a, b: a * b)]


def sample(rng):
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        word, sym, fn = rng.choice(OPS)
        msgs = [{'role': 'user', 'content': f'Please {word} {a} and {b}.'},
                {'role': 'assistant', 'content': f'{a} {sym} {b} = {fn(a, b)}'}]
    elif kind == 1:
        name = rng.choice(NAMES)
        n = rng.randrange(1, 5)
        msgs = [{'role': 'user', 'content': f'Write a Python function named {name} that returns {n}.'},
                {'role': 'assistant', 'content': f'def {name}():\n    return {n}'}]
    else:
        word = rng.choice(NAMES)
        msgs = [{'role': 'system', 'content': 'You are a terse assistant.'},
                {'role': 'user', 'content': f'Spell {word} backwards.'},
                {'role': 'assistant', 'content': word[::-1]}]
    if rng.random() < 0.2:  # some two-turn conversations
        msgs += [{'role': 'user', 'content': 'Thanks!'}, {'role': 'assistant', 'content': 'You are welcome.'}]
    return {'messages': msgs}


def build_model(out: str | Path, vocab: int = 1500, seed: int = 0) -> dict:
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    tokenizer, _ = build_tokenizer(vocab)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"), architectures=["Qwen3MoeForCausalLM"])
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id, do_sample=False, max_new_tokens=32).save_pretrained(out)
    return {"out": str(out), "vocab": len(tokenizer), "params": sum(p.numel() for p in model.parameters())}


def build_dataset(out: str | Path, n: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for _ in range(n):
            f.write(json.dumps(sample(rng), ensure_ascii=False) + "\n")
    return out


def build(workdir: str | Path) -> dict:
    """Model at <workdir>/tiny-moe and data at <workdir>/data.jsonl; skipped when already built."""
    workdir = Path(workdir)
    model_dir, data = workdir / "tiny-moe", workdir / "data.jsonl"
    info = {"model": str(model_dir), "data": str(data), "built": False}
    if not (model_dir / "model.safetensors").exists():
        build_model(model_dir)
        info["built"] = True
    if not data.exists():
        build_dataset(data)
        info["built"] = True
    return info
