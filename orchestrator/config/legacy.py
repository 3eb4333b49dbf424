"""ms-swift 2.x and 3.x values that 4.x reads differently, rewritten into their 4.x form before the translation:
2.x spellings 4.x rejects (`--dtype bf16`, `--deepspeed default-zero3`, `--lora_target_modules ALL`, `AUTO` for
"let ms-swift choose"), 2.x sampling flags that became `--dataset name#N`, `--quantization_bit` that implied
bitsandbytes, `--use_flash_attn`, and 3.x Megatron's `--no_X true` switches that 4.x spells `--X false`.

Each rewrite keeps the flag as written (so that the report and the round-trip check name it) with its 4.x value,
and says what it did: a value the translation cannot carry is dropped with the reason, a converted one gets a
note. Flag names are renamed later, by flags.RENAMED. Pure.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from orchestrator.config import flags as F
from orchestrator.config.command_form import Flag, Training
from orchestrator.config.import_values import convert

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_AUTO_WHY = {
    "dtype": "AUTO (2.x): the model's own dtype; ms-swift 4 takes it when --torch_dtype is not given (the recipe "
             "renders model.torch_dtype, bfloat16 unless set)",
    "template_type": "AUTO (2.x): the model's own template, which ms-swift 4 picks when --template is not given",
    "bnb_4bit_comp_dtype": "AUTO (2.x): the training dtype, which ms-swift 4 uses when --bnb_4bit_compute_dtype "
                           "is not given",
    "lora_dtype": "AUTO (2.x): ms-swift 4 picks the LoRA weights' dtype itself when --lora_dtype is not given",
}
_DEEPSPEED = {"default-zero2": "zero2", "default-zero3": "zero3", "zero2-offload": "zero2_offload",
              "zero3-offload": "zero3_offload"}
# 2.x keywords in --lora_target_modules / --lora_modules_to_save, and their 4.x names
_TARGETS = {"ALL": "all-linear", "EMBEDDING": "all-embedding"}
_TO_SAVE = {"EMBEDDING": "all-embedding", "LN": "all-norm"}
_MODEL_DEFAULT = ("DEFAULT", "AUTO")
# 3.x Megatron `--no_X` switches whose 4.x flag is not plainly X
_NEGATED = {"no_rope_fusion": "apply_rope_fusion", "no_bias_swiglu_fusion": "bias_activation_fusion"}


@dataclass
class Modernised:
    """Holds the command with its values in 4.x form, and what the rewrite dropped ({flag, value, reason}) or noted."""

    training: Training
    dropped: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _bool(values: tuple[str, ...]) -> bool | None:
    """Reads a bare flag or a true/false word as a bool, as the recipe's values are read; returns None for
    anything else."""
    try:
        return bool(convert(values, bool))
    except ValueError:
        return None


def _sampled(name: str, n: int) -> str:
    """Returns `name#n`, keeping the smaller count when `name` already has one (as 2.x's sampling did)."""
    base, hash_, count = name.partition("#")
    return f"{base}#{min(n, int(count))}" if hash_ and count.isdigit() else f"{name}#{n}"


class _Rewrite:
    """Rewrites the flags in one pass: `flags` holds the result in order, `dropped` and `notes` what it did."""

    def __init__(self, t: Training):
        self.t, self.backend = t, t.backend
        self.flags: list[Flag] = []
        self.dropped: list[dict] = []
        self.notes: list[str] = []

    def drop(self, f: Flag, reason: str) -> None:
        """Records `f` as not carried over, with the reason."""
        self.dropped.append({"flag": f.written, "value": " ".join(f.values), "reason": reason})

    def keep(self, f: Flag, values: tuple[str, ...], name: str | None = None) -> None:
        """Keeps `f` with `values` (under `name`), noting the change when there is one."""
        if values != f.values or (name and name != f.name):
            shown = f"--{F.RENAMED[self.backend].get(name or f.name, name or f.name)} {' '.join(values)}"
            self.notes.append(f"{f.text} is read as `{shown}` (its ms-swift 4 form)")
        self.flags.append(replace(f, name=name or f.name, values=values))

    def datasets(self, key: str) -> int | None:
        """Finds the index in `flags` of the last flag whose 4.x name is `key`; returns None if there is none yet."""
        for i in range(len(self.flags) - 1, -1, -1):
            if F.RENAMED[self.backend].get(self.flags[i].name, self.flags[i].name) == key:
                return i
        return None

    def one(self, f: Flag) -> None:
        """Rewrites one flag, or keeps it as it is when 4.x reads it the same way."""
        name, values = f.name, f.values
        word = values[0] if len(values) == 1 else None
        if name in _AUTO_WHY and word == "AUTO":
            self.drop(f, _AUTO_WHY[name])
        elif name in ("dtype", "bnb_4bit_comp_dtype", "lora_dtype", "torch_dtype") and word in _DTYPES:
            self.keep(f, (_DTYPES[word],))
        elif name == "deepspeed" and word in _DEEPSPEED:
            self.keep(f, (_DEEPSPEED[word],))
        elif name in ("lora_target_modules", "target_modules", "lora_modules_to_save") and \
                any(v.isupper() for v in values):
            self.keywords(f)
        elif name == "use_flash_attn" and _bool(values) is not None:
            if _bool(values):
                self.keep(f, ("flash_attn",) if self.backend == "swift" else ("flash",))
            else:
                self.drop(f, "false: ms-swift 4 chooses the attention implementation itself (--attn_impl / "
                             "--attention_backend)")
        elif name == "quantization_bit" and word is not None and word.isdigit():
            self.quantization(f, int(word))
        elif name in ("train_dataset_sample", "self_cognition_sample") and word is not None and \
                re.fullmatch(r"-?\d+", word):
            self.sampling(f, int(word))
        elif (name in _NEGATED or (name.startswith("no_") and name not in F.KNOWN[self.backend]
                                   and name[3:] in F.KNOWN[self.backend])) and _bool(values) is not None:
            self.keep(f, ("false" if _bool(values) else "true",), _NEGATED.get(name, name[3:]))
        else:
            self.flags.append(f)

    def keywords(self, f: Flag) -> None:
        """Spells 2.x's upper-case module keywords the 4.x way; drops the model-specific DEFAULT, which 4.x lacks."""
        table = _TO_SAVE if f.name == "lora_modules_to_save" else _TARGETS
        kept = tuple(table.get(v, v) for v in f.values if v not in _MODEL_DEFAULT)
        if len(kept) == len(f.values):
            self.keep(f, kept)
            return
        why = ("DEFAULT (2.x): the model type's own default modules (usually the attention projections), which "
               "ms-swift 4 does not know; its default is all-linear")
        if not kept:
            self.drop(f, why + ": set lora.target_modules to the modules you mean")
        else:
            self.notes.append(f"{f.text}: " + why + f"; imported as {' '.join(kept)}")
            self.flags.append(replace(f, values=kept))

    def quantization(self, f: Flag, bits: int) -> None:
        """Keeps 2.x --quantization_bit N (renamed to --quant_bits) and adds the method 2.x chose (bnb for 4 and 8
        bits, else hqq)."""
        if bits == 0:
            self.drop(f, "0 (2.x): no quantization, ms-swift 4's default")
            return
        self.flags.append(f)
        if not any(g.name == "quant_method" for g in self.t.flags):
            method = "bnb" if bits in (4, 8) else "hqq"
            self.flags.append(Flag("quant_method", "--quant_method", (method,), f.line))
            self.notes.append(f"--quant_method {method} added: ms-swift 2.x quantized with {method} for "
                              f"{f.text}, and 4.x needs the method named")

    def sampling(self, f: Flag, n: int) -> None:
        """Folds 2.x's sample counts into `--dataset` entries (`name#N`), as 3.x and 4.x write them."""
        if n <= 0:
            self.drop(f, f"{n} (2.x): no sampling, ms-swift 4's default")
            return
        i = self.datasets("dataset")
        if f.name == "self_cognition_sample":
            entry = f"swift/self-cognition#{n}"
            if i is None:
                self.flags.append(Flag("dataset", "--dataset", (entry,), f.line))
            else:
                d = self.flags[i]
                self.flags[i] = replace(d, values=(*[v for v in d.values if "self-cognition" not in v], entry))
            self.drop(f, f"2.x added {n} self-cognition samples: --dataset now ends in {entry} (with --model_name "
                         "and --model_author)")
        elif i is None or len(self.flags[i].values) != 1:
            self.drop(f, "ms-swift 2.x sampled only a single --dataset this way (it ignored the count otherwise); "
                         "write a count as `--dataset name#N`")
        else:
            d = self.flags[i]
            self.flags[i] = replace(d, values=(_sampled(d.values[0], n),))
            self.drop(f, f"folded into --dataset: {self.flags[i].values[0]} (the `name#N` form)")


def modernise(t: Training) -> Modernised:
    """Returns `t` with its 2.x / 3.x values in 4.x form, and says what was dropped or converted."""
    r = _Rewrite(t)
    sampling = ("train_dataset_sample", "self_cognition_sample")  # 2.x applied them in this order, after the rest
    for f in [f for f in t.flags if f.name not in sampling] + \
            sorted((f for f in t.flags if f.name in sampling), key=lambda f: sampling.index(f.name)):
        r.one(f)
    return Modernised(replace(t, flags=tuple(r.flags)), r.dropped, r.notes)
