"""Recipe loading, validation messages, --set overrides, path resolution and the recipe hash."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import DROP, MINIMAL, MODEL_CONFIG, RECIPES, ROOT, make_model, merge
from orchestrator.config import recipe as R
from orchestrator.config.recipe import RecipeError, apply_overrides, changed_keys, parse_override, recipe_hash, semantic_view


# --- the shipped recipes ---------------------------------------------------------------------------

def test_recipes_found():
    names = {p.name for p in RECIPES}
    assert {"demo-cpu.toml", "qwen3-235b-a22b-lora-ep8.toml", "qwen3.5-397b-a17b-lora-ep8.toml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    r = R.load(path)
    assert r.run.name
    assert Path(r.model.path).is_absolute()
    assert len(recipe_hash(r)) == 64


@pytest.mark.parametrize("path,backend,ep,experts", [
    ("qwen3.5-397b-a17b-lora-ep8.toml", "megatron", 8, 512),
    ("qwen3-235b-a22b-lora-ep8.toml", "megatron", 8, 128),
    ("demo-cpu.toml", "swift", 1, None),
])
def test_recipe_facts(path, backend, ep, experts):
    r = R.load(ROOT / "recipes" / path)
    assert r.run.backend == backend
    assert r.parallel.expert == ep
    if experts is not None:
        assert R.expert_count(r) == experts


def test_minimal_fixture_loads(write_recipe, tmp_path):
    r = R.load(write_recipe())
    assert r.model.path == str(tmp_path / "model")
    assert r.data.dataset == [str(tmp_path / "data.jsonl")]
    assert r.run.output_dir == str(tmp_path / "out")
    assert R.expert_count(r) == 16
    assert r.parallel.data_parallel == 8


# --- bad input: one RecipeError naming the file and the key ---------------------------------------

BAD = [
    # (id, sections merged into MINIMAL, fragments the message must hold)
    ("unknown-key", {"optim": {"lrr": 1e-4}}, ["optim.lrr", "unknown key", "did you mean 'optim.lr'"]),
    ("unknown-key-parallel", {"parallel": {"experts": 8}}, ["parallel.experts", "did you mean 'parallel.expert'"]),
    ("unknown-section", {"optimm": {"lr": 1.0}}, ["optimm", "unknown key", "did you mean 'optim'"]),
    ("unknown-key-no-suggestion", {"lora": {"zzzzzz": 1}}, ["lora.zzzzzz", "unknown key"]),
    ("str-for-int", {"lora": {"rank": "8"}}, ["lora.rank", "'8'"]),
    ("str-for-float", {"optim": {"lr": "1e-4"}}, ["optim.lr", "'1e-4'"]),
    ("str-for-bool", {"data": {"packing": "true"}}, ["data.packing", "'true'"]),
    ("int-for-bool", {"data": {"packing": 1}}, ["data.packing"]),
    ("float-for-int", {"parallel": {"expert": 8.0}}, ["parallel.expert"]),
    ("str-for-list", {"data": {"dataset": "data.jsonl"}}, ["data.dataset"]),
    ("bad-literal", {"run": {"backend": "deepspeed"}}, ["run.backend"]),
    ("bad-name", {"run": {"name": "a b"}}, ["run.name"]),
    ("zero-rank", {"lora": {"rank": 0}}, ["lora.rank"]),
    ("negative-lr", {"optim": {"lr": -1.0}}, ["optim.lr"]),
    ("empty-dataset", {"data": {"dataset": []}}, ["data.dataset"]),
    ("empty-target-modules", {"lora": {"target_modules": []}}, ["lora.target_modules"]),
    ("save-total-limit-1", {"checkpoint": {"save_total_limit": 1}}, ["checkpoint.save_total_limit"]),
    ("missing-model-path", {"model": {"path": DROP, "model_type": "qwen3_moe"}},
     ["model.path", "required key is missing"]),
    ("missing-lr", {"optim": {"lr": DROP}}, ["optim.lr", "required key is missing"]),
    ("missing-run", {"run": DROP}, ["run", "required key is missing"]),
    ("missing-data", {"data": DROP}, ["data", "required key is missing"]),
    ("epochs-and-iterations", {"optim": {"epochs": 1.0}}, ["optim.epochs", "optim.iterations"]),
    ("neither-epochs-nor-iterations", {"optim": {"iterations": DROP}}, ["optim.epochs", "optim.iterations"]),
    ("fractional-epochs-megatron", {"optim": {"iterations": DROP, "epochs": 1.5}}, ["optim.epochs", "whole number"]),
    ("tp-not-dividing", {"parallel": {"tensor": 3, "expert": 1}},
     ["parallel.nproc_per_node: 8", "tensor x pipeline x context = 3"]),
    ("tp-pp-cp-not-dividing", {"parallel": {"tensor": 2, "pipeline": 2, "context": 4, "expert": 1}},
     ["tensor x pipeline x context = 16"]),
    ("ep-not-dividing-nproc", {"parallel": {"expert": 3}},
     ["parallel.nproc_per_node: 8", "expert x expert_tensor x pipeline = 3"]),
    ("ep-etp-not-dividing", {"parallel": {"expert": 8, "expert_tensor": 2}},
     ["expert x expert_tensor x pipeline = 16"]),
    ("sp-without-tp", {"parallel": {"sequence_parallel": True}}, ["parallel.sequence_parallel", "parallel.tensor"]),
    ("gbs-not-divisible", {"optim": {"global_batch_size": 12}}, ["optim.global_batch_size: 12", "1 x 8"]),
    ("gbs-micro-not-divisible", {"optim": {"global_batch_size": 16, "micro_batch_size": 4}}, ["4 x 8"]),
    ("min-lr-above-lr", {"optim": {"min_lr": 1e-3}}, ["optim.min_lr", "optim.lr"]),
    ("recompute-method-selective", {"memory": {"recompute_method": "uniform"}}, ["memory.recompute_method", "full"]),
    ("recompute-layers-none", {"memory": {"recompute_granularity": "none", "recompute_num_layers": 1}},
     ["recompute_num_layers", "full"]),
    ("swift-with-ep", {"run": {"backend": "swift"}}, ["parallel", "megatron"]),
    ("swift-with-tp", {"run": {"backend": "swift"}, "parallel": {"expert": 1, "tensor": 2}}, ["megatron"]),
    ("swift-with-full-recompute", {"run": {"backend": "swift"}, "parallel": {"expert": 1},
                                   "memory": {"recompute_granularity": "full"}}, ["memory", "megatron"]),
    ("swift-with-offload", {"run": {"backend": "swift"}, "parallel": {"expert": 1},
                            "memory": {"optimizer_cpu_offload": True}}, ["memory", "megatron"]),
    ("target-parameters-megatron", {"lora": {"target_parameters": ["experts.gate_up_proj"]}},
     ["lora.target_parameters", "swift"]),
    ("ep-not-dividing-experts-config", {"model": {"path": "model12"}}, ["parallel.expert: 8", "12 experts",
                                                                         "divisor of 12"]),
    ("ep-not-dividing-num-experts", {"model": {"num_experts": 20}}, ["parallel.expert", "20 experts"]),
    ("extra-unknown", {"extra_args": {"moe_aux_loss_cof": 1e-3}}, ["extra_args.moe_aux_loss_cof", "did you mean",
                                                                   "moe_aux_loss_coeff"]),
    ("extra-save-interval", {"extra_args": {"save_interval": 50}}, ["extra_args.save_interval", "save_steps"]),
    ("extra-learning-rate-megatron", {"extra_args": {"learning_rate": 1e-4}}, ["extra_args.learning_rate", "lr"]),
    ("extra-use-megatron", {"extra_args": {"use_megatron": True}}, ["extra_args.use_megatron", "does not exist"]),
    ("extra-megatron-use-mcore", {"extra_args": {"megatron_use_mcore": True}}, ["extra_args.megatron_use_mcore"]),
    ("extra-train-type", {"extra_args": {"train_type": "lora"}}, ["extra_args.train_type", "tuner_type"]),
    ("extra-managed-ep", {"extra_args": {"expert_model_parallel_size": 8}},
     ["extra_args.expert_model_parallel_size", "set recipe key parallel.expert instead"]),
    ("extra-managed-dash", {"extra_args": {"expert-model-parallel-size": 8}},
     ["set recipe key parallel.expert instead"]),
    ("extra-managed-save-steps", {"extra_args": {"save_steps": 5}}, ["set recipe key checkpoint.save_steps instead"]),
    ("extra-on-resume", {"extra_args": {"mcore_adapter": "/x"}}, ["extra_args.mcore_adapter", "on resume"]),
    ("extra-lr-swift", {"run": {"backend": "swift"}, "parallel": {"expert": 1}, "extra_args": {"lr": 1e-4}},
     ["extra_args.lr", "learning_rate"]),
    ("async-save-with-save-total-limit", {"checkpoint": {"async_save": True, "save_total_limit": 3}},
     ["checkpoint.async_save", "ms-swift refuses --async_save with --save_total_limit", "keep_local"]),
    ("async-save-swift", {"run": {"backend": "swift"}, "parallel": {"expert": 1}, "checkpoint": {"async_save": True}},
     ["checkpoint.async_save", "`swift sft` has no --async_save"]),
    ("no-safetensors-swift", {"run": {"backend": "swift"}, "parallel": {"expert": 1},
                              "checkpoint": {"merge": "final", "save_safetensors": False}},
     ["checkpoint.save_safetensors", "needs run.backend = \"megatron\""]),
    ("no-safetensors-every-save", {"checkpoint": {"merge": "every_save", "save_safetensors": False}},
     ["checkpoint.save_safetensors", "merged copy only with --save_safetensors true"]),
    ("no-safetensors-weights-only", {"checkpoint": {"merge": "final", "keep_optimizer": False,
                                                    "save_safetensors": False}},
     ["checkpoint.save_safetensors", "keep_optimizer = false resumes from the HF adapter"]),
    ("extra-empty-list", {"extra_args": {"modules_to_save": []}}, ["extra_args.modules_to_save", "empty list"]),
    ("extra-dict-value", {"extra_args": {"moe_aux_loss_coeff": {"a": 1}}}, ["extra_args.moe_aux_loss_coeff"]),
    ("env-bad-name", {"env": {"vars": {"1BAD": "x"}}}, ["env.vars", "'1BAD'"]),
    ("env-dash-name", {"env": {"vars": {"MY-VAR": "x"}}}, ["env.vars", "'MY-VAR'"]),
    ("env-int-value", {"env": {"vars": {"OMP_NUM_THREADS": 4}}}, ["env.vars.OMP_NUM_THREADS"]),
    ("env-bad-preset", {"env": {"nccl_preset": "nvlink"}}, ["env.nccl_preset"]),
    ("kill-pattern-regex", {"gpu": {"kill_patterns": ["python(", "ok"]}}, ["gpu.kill_patterns", "'python('",
                                                                          "regular expression"]),
    ("port-range-low", {"supervisor": {"port_range": [80, 90]}}, ["supervisor.port_range", "1024"]),
    ("port-range-reversed", {"supervisor": {"port_range": [29600, 29500]}}, ["supervisor.port_range"]),
    ("port-range-high", {"supervisor": {"port_range": [29500, 70000]}}, ["supervisor.port_range"]),
    ("port-range-len", {"supervisor": {"port_range": [29500]}}, ["supervisor.port_range"]),
    ("port-range-3", {"supervisor": {"port_range": [1, 2, 3]}}, ["supervisor.port_range"]),
    ("listen-no-port", {"metrics": {"listen": "127.0.0.1"}}, ["metrics.listen"]),
    ("listen-word-port", {"metrics": {"listen": "127.0.0.1:http"}}, ["metrics.listen"]),
    ("listen-space", {"metrics": {"listen": "my host:9400"}}, ["metrics.listen"]),
    ("listen-port-too-big", {"metrics": {"listen": "127.0.0.1:99999"}}, ["metrics.listen", "65535"]),
    ("bad-on-drift", {"run": {"on_drift": "ignore"}}, ["run.on_drift"]),
    ("bad-dtype", {"model": {"torch_dtype": "fp8"}}, ["model.torch_dtype"]),
    ("split-ratio-1", {"data": {"split_dataset_ratio": 1.0}}, ["data.split_dataset_ratio"]),
    ("offload-fraction-2", {"memory": {"optimizer_offload_fraction": 2.0}}, ["memory.optimizer_offload_fraction"]),
]


@pytest.mark.parametrize("sections,fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_recipe(write_recipe, tmp_path, sections, fragments):
    make_model(tmp_path / "model12", {**MODEL_CONFIG, "num_experts": 12})
    path = write_recipe(**sections)
    with pytest.raises(RecipeError) as e:
        R.load(path)
    msg = str(e.value)
    assert all(line.startswith(f"{path}: ") for line in msg.splitlines()), msg  # one line per problem
    for f in fragments:
        assert f in msg, (f, msg)
    assert "Traceback" not in msg


@pytest.mark.parametrize("section", ["model", "data", "run"])
def test_section_not_a_table(write_recipe, section):
    path = write_recipe(**{section: DROP})
    path.write_text(f'{section} = "x"\n' + path.read_text())
    with pytest.raises(RecipeError) as e:
        R.load(path)
    assert str(e.value).startswith(f"{path}: {section}")


def test_ep_divides_experts_ok(write_recipe, tmp_path):
    make_model(tmp_path / "model12", {**MODEL_CONFIG, "num_experts": 12})
    r = R.load(write_recipe(parallel={"expert": 4}, model={"path": "model12"}))
    assert R.expert_count(r) == 12


@pytest.mark.parametrize("config,expected", [
    ({"num_experts": 16}, 16),
    ({"n_routed_experts": 32}, 32),
    ({"num_local_experts": 8}, 8),
    ({"text_config": {"num_experts": 512}}, 512),
    ({"hidden_size": 8}, None),
])
def test_expert_count_from_config(write_recipe, tmp_path, config, expected):
    make_model(tmp_path / "m2", config)
    r = R.load(write_recipe(model={"path": "m2"}, parallel={"expert": 1}))
    assert R.expert_count(r) == expected


def test_num_experts_key_wins_over_config(write_recipe):
    r = R.load(write_recipe(model={"num_experts": 64}))
    assert R.expert_count(r) == 64


@pytest.mark.parametrize("content", ["[1, 2]", "not json", ""])
def test_unreadable_config_is_unknown(write_recipe, tmp_path, content):
    d = tmp_path / "m3"
    d.mkdir()
    (d / "config.json").write_text(content)
    r = R.load(write_recipe(model={"path": "m3"}))
    assert R.read_model_config(r) is None
    assert R.expert_count(r) is None


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(RecipeError, match="not found") as e:
        R.load(path)
    assert str(path) in str(e.value)


def test_directory_is_not_a_recipe(tmp_path):
    with pytest.raises(RecipeError, match="cannot read") as e:
        R.load(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_not_utf8(tmp_path):
    path = tmp_path / "bin.toml"
    path.write_bytes(b"\xff\xfe[run]\n")
    with pytest.raises(RecipeError, match="UTF-8") as e:
        R.load(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("text,line", [
    ("[run]\nname = \n", 2),
    ("[run]\nname = 'a'\n\n[optim\nlr = 1\n", 4),
    ("[run]\nname = 'a'\nname = 'b'\n", 3),
    ("[run]\nname 'a'\n", 2),
])
def test_toml_syntax_error_names_line(tmp_path, text, line):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(RecipeError) as e:
        R.load(path)
    msg = str(e.value)
    assert msg.startswith(str(path)) and "TOML syntax error" in msg
    assert f"line {line}" in msg, msg


def test_every_problem_listed_with_its_key_and_suggestion(write_recipe):
    path = write_recipe(optim={"lrr": 1e-4}, lora={"rank": "8"}, data={"packing": "true"})
    with pytest.raises(RecipeError) as e:
        R.load(path)
    lines = str(e.value).splitlines()
    assert "more problem" not in str(e.value)
    assert sorted(lines) == sorted([f"{path}: optim.lrr: unknown key (did you mean 'optim.lr'?)",
                                    f"{path}: lora.rank: Input should be a valid integer, got '8'",
                                    f"{path}: data.packing: Input should be a valid boolean, got 'true'"])
    assert [(p.key, p.source) for p in e.value.problems] == [(ln.split(": ")[1], str(path)) for ln in lines]


def test_every_cross_key_problem_listed(write_recipe):
    path = write_recipe(optim={"min_lr": 1e-3, "global_batch_size": 12},
                        memory={"recompute_method": "uniform"})
    with pytest.raises(RecipeError) as e:
        R.load(path)
    assert [p.key for p in e.value.problems] == ["optim.global_batch_size", "optim.min_lr", "memory.recompute_method"]


def test_validate_without_file():
    with pytest.raises(RecipeError, match=r"^<recipe>: optim.lr"):
        R.validate(merge(MINIMAL, {"optim": {"lr": "x"}}))


# --- --set ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("item,keys,value", [
    ("optim.lr=1e-4", ["optim", "lr"], 1e-4),
    ("optim.lr=2E-5", ["optim", "lr"], 2e-5),
    ("lora.rank=16", ["lora", "rank"], 16),
    ("optim.epochs=1.5", ["optim", "epochs"], 1.5),
    ("data.packing=true", ["data", "packing"], True),
    ("data.packing=false", ["data", "packing"], False),
    ("run.name=foo", ["run", "name"], "foo"),
    ('run.name="foo"', ["run", "name"], "foo"),
    ("run.name='foo bar'", ["run", "name"], "foo bar"),
    ("run.output_dir=/nvme/x y", ["run", "output_dir"], "/nvme/x y"),
    ("run.output_dir=/a/b=c", ["run", "output_dir"], "/a/b=c"),
    ('data.dataset=["a.jsonl", "b.jsonl"]', ["data", "dataset"], ["a.jsonl", "b.jsonl"]),
    ("supervisor.port_range=[29500, 29510]", ["supervisor", "port_range"], [29500, 29510]),
    ("env.vars.NCCL_DEBUG=INFO", ["env", "vars", "NCCL_DEBUG"], "INFO"),
    ("extra_args.moe_aux_loss_coeff=1e-3", ["extra_args", "moe_aux_loss_coeff"], 1e-3),
    ("  optim.lr = 3e-4  ", ["optim", "lr"], 3e-4),
    ("run.name=", ["run", "name"], ""),
    ("run.name=8", ["run", "name"], 8),  # a TOML int; validation then rejects it for a str field
])
def test_parse_override(item, keys, value):
    k, v = parse_override(item)
    assert k == keys
    assert v == value and type(v) is type(value)


@pytest.mark.parametrize("item", ["foo", "=1", "a=1", "optim.=1", ".lr=1", "optim lr=1", "1a.b=2", "optim..lr=1",
                                  "optim.lr", "", "optim-x.lr=1"])
def test_parse_override_malformed(item):
    with pytest.raises(RecipeError, match="dotted.key=value"):
        parse_override(item)


def test_apply_overrides_nested_new_tables_and_copy():
    data = {"optim": {"lr": 1.0}}
    out = apply_overrides(data, ["env.vars.FOO=bar", "optim.lr=2.0", "optim.lr=3.0", "a.b.c.d=1"])
    assert out == {"optim": {"lr": 3.0}, "env": {"vars": {"FOO": "bar"}}, "a": {"b": {"c": {"d": 1}}}}
    assert data == {"optim": {"lr": 1.0}}, "input not mutated"


@pytest.mark.parametrize("item", ["optim.lr.x=1", "run.name.first=a"])
def test_apply_overrides_through_a_value(item):
    with pytest.raises(RecipeError, match="is not a table"):
        apply_overrides({"optim": {"lr": 1.0}, "run": {"name": "a"}}, [item])


@pytest.mark.parametrize("override,check", [
    ("optim.lr=5e-5", lambda r: r.optim.lr == 5e-5),
    ("lora.rank=64", lambda r: r.lora.rank == 64),
    ("data.packing=true", lambda r: r.data.packing is True),
    ("run.name=other-name", lambda r: r.run.name == "other-name"),
    ("env.vars.NCCL_DEBUG=WARN", lambda r: r.env.vars == {"NCCL_DEBUG": "WARN"}),
    ("parallel.expert=4", lambda r: r.parallel.expert == 4),
    ("extra_args.moe_aux_loss_coeff=0.01", lambda r: r.extra_args == {"moe_aux_loss_coeff": 0.01}),
])
def test_load_with_override(write_recipe, override, check):
    assert check(R.load(write_recipe(), [override]))


@pytest.mark.parametrize("override,fragment", [
    ("lora.rank=x", "lora.rank"),
    ("lora.rank=1.5", "lora.rank"),
    ("optim.lrr=1", "did you mean 'optim.lr'"),
    ("parallel.expert=3", "parallel"),
    ("extra_args.save_interval=5", "extra_args.save_interval"),
    ("run.name=8", "run.name"),
])
def test_load_with_bad_override(write_recipe, override, fragment):
    path = write_recipe()
    with pytest.raises(RecipeError) as e:
        R.load(path, [override])
    assert str(e.value).startswith(f"--set {override!r}: ") and fragment in str(e.value), str(e.value)
    assert str(path) not in str(e.value), "a value from --set is not the file's fault"


def test_problems_from_the_file_and_from_set_each_attributed(write_recipe):
    path = write_recipe(lora={"rank": "8"})
    with pytest.raises(RecipeError) as e:
        R.load(path, ["optim.lr=-1", "optim.min_lr=0.5", "run.name=ok"])
    assert str(e.value).splitlines() == [
        f"{path}: lora.rank: Input should be a valid integer, got '8'",
        "--set 'optim.lr=-1': optim.lr: Input should be greater than 0, got -1"]
    with pytest.raises(RecipeError) as e:  # a cross-key problem goes to the --set that wrote one of its keys
        R.load(write_recipe(), ["optim.min_lr=0.5"])
    assert str(e.value) == "--set 'optim.min_lr=0.5': optim.min_lr: 0.5 is larger than optim.lr 0.0001"
    assert e.value.problems[0].as_dict() == {"key": "optim.min_lr", "message": "0.5 is larger than optim.lr 0.0001",
                                             "source": "--set 'optim.min_lr=0.5'"}


# --- relative paths ------------------------------------------------------------------------------

def test_relative_paths_resolve_against_recipe_dir(write_recipe, tmp_path, monkeypatch):
    sub = tmp_path / "elsewhere"
    sub.mkdir()
    monkeypatch.chdir(sub)
    r = R.load(write_recipe(run={"persistent_dir": "../persist"},
                            data={"dataset": ["data.jsonl", "./d/x", "org/hub-name", "/abs/y.jsonl", "z.jsonl#100",
                                              "w.csv"],
                                  "val_dataset": ["v.json"]}))
    assert r.run.output_dir == str(tmp_path / "out")
    assert r.run.persistent_dir == str(tmp_path.parent / "persist")
    assert r.data.dataset == [str(tmp_path / "data.jsonl"), str(tmp_path / "d" / "x"), "org/hub-name",
                              "/abs/y.jsonl", str(tmp_path / "z.jsonl#100"), str(tmp_path / "w.csv")]
    assert r.data.val_dataset == [str(tmp_path / "v.json")]


def test_relative_paths_not_through_symlink(tmp_path, write_recipe):
    real = write_recipe()
    linkdir = tmp_path / "links"
    linkdir.mkdir()
    make_model(linkdir / "model")
    (linkdir / "recipe.toml").symlink_to(real)
    r = R.load(linkdir / "recipe.toml")
    assert r.model.path == str(linkdir / "model")
    assert r.run.output_dir == str(linkdir / "out")


def test_demo_recipe_symlink_resolves_in_recipes_dir():
    link = ROOT / "recipes" / "demo-cpu.toml"
    assert link.is_symlink()
    r = R.load(link)
    assert r.model.path == str((ROOT / ".demo" / "tiny-moe").resolve())
    assert r.data.dataset == [str((ROOT / ".demo" / "data.jsonl").resolve())]
    # resolved beside the link (recipes/..), not beside its target (orchestrator/data/..): compared as paths,
    # since a clone's own folder may well be named `orchestrator`
    assert r.run.output_dir == str((ROOT / ".demo" / "run" / "out").resolve())
    assert r.run.output_dir != str((ROOT / "orchestrator" / ".demo" / "run" / "out").resolve())


def test_the_symlink_check_passes_in_a_clone_named_orchestrator(tmp_path):
    """A new user's `git clone` makes a folder named `orchestrator`: the check above must pass there too (it once
    asserted that the string `orchestrator/.demo` was absent from a path that then contains it)."""
    clone = tmp_path / "orchestrator"
    ignore = shutil.ignore_patterns(".git", ".venv", ".demo", "__pycache__", "*.egg-info", ".pytest_cache", "fixtures")
    clone.mkdir()
    for part in ("orchestrator", "recipes", "tests"):
        shutil.copytree(ROOT / part, clone / part, symlinks=True, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", clone / "pyproject.toml")
    assert (clone / "recipes" / "demo-cpu.toml").is_symlink()
    env = {**os.environ, "PYTHONPATH": str(clone)}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_recipe.py::test_demo_recipe_symlink_resolves_in_recipes_dir"],
                       cwd=clone, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 passed" in p.stdout


def test_absolute_paths_kept(write_recipe, tmp_path):
    r = R.load(write_recipe(run={"output_dir": "/nvme/runs/x"}))
    assert r.run.output_dir == "/nvme/runs/x"
    assert os.path.isabs(r.model.path)


# --- the recipe hash -----------------------------------------------------------------------------

FORMAT_A = """
[run]
name = "t"
backend = "megatron"
output_dir = "out"

[model]
path = "model"

[data]
dataset = ["data.jsonl"]

[parallel]
nproc_per_node = 8
expert = 8

[optim]
lr = 1e-4
iterations = 10

[extra_args]
moe_aux_loss_coeff = 1e-3
"""

FORMAT_B = """# same recipe, written differently
extra_args = { moe_aux_loss_coeff = 0.001 }   # inline table

[optim]   # sections in another order
iterations = 10
lr = 0.0001

[parallel]
expert      = 8
nproc_per_node=8

[data]
dataset = [
    'data.jsonl',   # literal string, trailing comma
]

[model]
path = 'model'

[run]
output_dir = "out"
backend = "megatron"
name = "t"
"""

FORMAT_C = """
run = {name = "t", output_dir = "out"}
model.path = "model"
data.dataset = ["data.jsonl"]
parallel = {nproc_per_node = 8, expert = 8, tensor = 1}
optim.lr = 1.0e-4
optim.iterations = 10
extra_args.moe_aux_loss_coeff = 1e-3
checkpoint.save_steps = 7
"""


def test_hash_stable_across_formatting(write_recipe, tmp_path):
    hashes = set()
    for name, text in [("a.toml", FORMAT_A), ("b.toml", FORMAT_B), ("c.toml", FORMAT_C)]:
        (tmp_path / name).write_text(text)
        hashes.add(recipe_hash(R.load(tmp_path / name)))
    assert len(hashes) == 1


def test_hash_stable_across_loads(write_recipe):
    path = write_recipe()
    assert recipe_hash(R.load(path)) == recipe_hash(R.load(path))


def test_hash_int_and_float_spelling(write_recipe):
    a = R.load(write_recipe(name="a.toml", optim={"iterations": DROP, "epochs": 1}))
    b = R.load(write_recipe(name="b.toml", optim={"iterations": DROP, "epochs": 1.0}))
    assert recipe_hash(a) == recipe_hash(b)


OPERATIONAL = [
    ["checkpoint.save_steps=7"], ["checkpoint.logging_steps=5"], ["checkpoint.keep_persistent=9"],
    ["checkpoint.sync_interval_s=10"], ["checkpoint.save_total_limit=4"], ["checkpoint.merge_lora=true"],
    ["checkpoint.keep_optimizer=false"], ["checkpoint.resume_loss_tolerance=0.2"],
    ['checkpoint.merge="final"'], ['checkpoint.merge="every_save"'], ["checkpoint.keep_local=1"],
    ["checkpoint.step_time_s=30"], ["checkpoint.async_save=true"], ["checkpoint.save_safetensors=true"],
    ["run.output_dir=/elsewhere/out"], ["run.persistent_dir=/mnt/p"], ["run.name=renamed"],
    ["run.on_drift=refuse"], ['run.entrypoint=["numactl", "megatron"]'],
    ["supervisor.wait_s=5"], ["supervisor.force_wait_s=5"], ["supervisor.grace_s=1"],
    ["supervisor.nccl_settle_s=0"], ["supervisor.hang_timeout_s=60"], ["supervisor.startup_timeout_s=60"],
    ["supervisor.max_crashes_per_hour=10"], ["supervisor.max_relaunches_without_progress=9"],
    ["supervisor.backoff_max_s=10"], ["supervisor.port_range=[30000, 30010]"], ["supervisor.poll_s=2"],
    ["supervisor.min_free_gib=1"], ["supervisor.spot_notice_file=/tmp/notice"],
    ["gpu.check=false"], ["gpu.clear_threshold_mib=10"], ['gpu.kill_patterns=["python"]'], ["gpu.capacity_gib=80"],
    ["metrics.enabled=false"], ["metrics.listen=0.0.0.0:9500"],
    ["env.vars.NCCL_DEBUG=INFO"], ["env.nccl_preset=pcie"],
    ["memory.recompute_granularity=full"], ["memory.recompute_granularity=none"],
    ["memory.recompute_granularity=full", "memory.recompute_method=uniform", "memory.recompute_num_layers=1"],
    ["memory.optimizer_cpu_offload=true"], ["memory.optimizer_offload_fraction=0.5"],
    ["memory.precision_aware_optimizer=true"],
    ["parallel.ddp_timeout_s=60"], ["model.num_experts=16"],
    ["data.dataset_num_proc=4"], ["data.dataloader_num_workers=2"],
    ['extra_args.report_to="wandb"'], ["extra_args.wandb_exp_name=e"], ["extra_args.save_total_limit=3"],
    ["extra_args.eval_steps=50"], ["extra_args.eval_iters=5"], ["extra_args.tensorboard_dir=/tb"],
    ["extra_args.wandb_project=p"], ["extra_args.async_save=true"], ["extra_args.create_checkpoint_symlink=true"],
    ["extra_args.tensorboard_queue_size=100"],
    ["health.loss_max=10"], ["health.grad_norm_max=100"], ['health.on_divergence="rollback"'],
    ["health.slowdown_ratio=2.0"], ["health.slowdown_window_s=60"], ['health.on_slowdown="restart"'],
    ["health.spike_window=50"], ["health.divergence_tolerance=0.2"], ["health.resume_window=5"],
]


@pytest.mark.parametrize("overrides", OPERATIONAL, ids=lambda o: " ".join(o))
def test_hash_ignores_operational_keys(write_recipe, overrides):
    path = write_recipe()
    base, changed = R.load(path), R.load(path, overrides)
    assert changed != base, "the override must take effect"
    assert recipe_hash(changed) == recipe_hash(base)
    assert changed_keys(semantic_view(base), semantic_view(changed)) == []


SEMANTIC = [
    (["optim.lr=2e-4"], ["optim.lr"]),
    (["optim.min_lr=1e-6"], ["optim.min_lr"]),
    (["optim.warmup_fraction=0.1"], ["optim.warmup_fraction"]),
    (["optim.micro_batch_size=2"], ["optim.micro_batch_size"]),
    (["optim.global_batch_size=32"], ["optim.global_batch_size"]),
    (["optim.iterations=11"], ["optim.iterations"]),
    (["optim.seed=1"], ["optim.seed"]),
    (["lora.rank=16"], ["lora.rank"]),
    (["lora.alpha=16"], ["lora.alpha"]),
    (["lora.dropout=0.1"], ["lora.dropout"]),
    (['lora.target_modules=["linear_qkv"]'], ["lora.target_modules"]),
    (["data.max_length=4096"], ["data.max_length"]),
    (["data.packing=true"], ["data.packing"]),
    (["data.split_dataset_ratio=0.01"], ["data.split_dataset_ratio"]),
    (['data.dataset=["other.jsonl"]'], ["data.dataset"]),
    (['data.val_dataset=["val.jsonl"]'], ["data.val_dataset"]),
    (["parallel.expert=4"], ["parallel.expert"]),
    (["parallel.tensor=2"], ["parallel.tensor"]),
    (["parallel.tensor=2", "parallel.sequence_parallel=true"], ["parallel.sequence_parallel", "parallel.tensor"]),
    (["parallel.nproc_per_node=4", "parallel.expert=4"], ["parallel.expert", "parallel.nproc_per_node"]),
    (["parallel.pipeline=2", "parallel.expert=4"], ["parallel.expert", "parallel.pipeline"]),
    (["parallel.context=2"], ["parallel.context"]),
    (["parallel.expert=4", "parallel.expert_tensor=2"], ["parallel.expert", "parallel.expert_tensor"]),
    (["model.path=/models/other"], ["model.path"]),
    (["model.model_type=qwen3_moe"], ["model.model_type"]),
    (["model.template=qwen3"], ["model.template"]),
    (["model.torch_dtype=float16"], ["model.torch_dtype"]),
    (["extra_args.moe_aux_loss_coeff=1e-3"], ["extra_args.moe_aux_loss_coeff"]),
    (['extra_args.attention_backend="fused"'], ["extra_args.attention_backend"]),
    (["extra_args.moe_grouped_gemm=false"], ["extra_args.moe_grouped_gemm"]),
]


@pytest.mark.parametrize("overrides,keys", SEMANTIC, ids=lambda o: " ".join(o) if isinstance(o, list) else None)
def test_hash_changes_with_semantic_keys(write_recipe, overrides, keys):
    path = write_recipe()
    base, changed = R.load(path), R.load(path, overrides)
    assert recipe_hash(changed) != recipe_hash(base)
    assert changed_keys(semantic_view(base), semantic_view(changed)) == keys


def test_hash_changes_epochs_for_iterations(write_recipe):
    a = R.load(write_recipe(name="a.toml"))
    b = R.load(write_recipe(name="b.toml", optim={"iterations": DROP, "epochs": 2}))
    assert recipe_hash(a) != recipe_hash(b)
    assert changed_keys(semantic_view(a), semantic_view(b)) == ["optim.epochs", "optim.iterations"]


def test_hash_changes_with_backend(write_recipe):
    a = R.load(write_recipe(name="a.toml", parallel={"expert": 1}))
    b = R.load(write_recipe(name="b.toml", parallel={"expert": 1}, run={"backend": "swift"}))
    assert changed_keys(semantic_view(a), semantic_view(b)) == ["run.backend"]


@pytest.mark.parametrize("old,new,keys", [
    ({}, {}, []),
    ({"optim": {"lr": 1}}, {"optim": {"lr": 1}}, []),
    ({"optim": {"lr": 1}}, {"optim": {"lr": 2}}, ["optim.lr"]),
    ({"optim": {"lr": 1}}, {}, ["optim.lr"]),
    ({}, {"extra_args": {"x": 1}}, ["extra_args.x"]),
    ({"b": {"z": 1, "a": 1}, "a": {"k": 1}}, {"b": {"z": 2, "a": 2}, "a": {"k": 2}}, ["a.k", "b.a", "b.z"]),
])
def test_changed_keys(old, new, keys):
    assert changed_keys(old, new) == keys


def test_semantic_view_leaves_out_operational_extra_args(write_recipe):
    r = R.load(write_recipe(extra_args={"report_to": "wandb", "moe_aux_loss_coeff": 0.01}))
    assert semantic_view(r)["extra_args"] == {"moe_aux_loss_coeff": 0.01}
    assert set(semantic_view(r)) == set(R.HASHED_KEYS) | {"extra_args"}


@pytest.mark.parametrize("value,line", [
    (float("nan"), "extra_args.x: Input should be a finite number, got nan"),
    (["a", 1], "extra_args.x.1: Input should be a valid string, got 1"),
    ({"a": 1}, "extra_args.x: a flag value must be a string, number, boolean or list of strings"),
])
def test_extra_arg_value_one_problem_not_one_per_union_member(value, line):
    with pytest.raises(RecipeError) as e:
        R.validate(merge(MINIMAL, {"extra_args": {"x": value}}))
    assert str(e.value) == f"<recipe>: {line}"


# --- checkpoint.merge and its deprecated spelling merge_lora --------------------------------------

@pytest.mark.parametrize("checkpoint,merge", [
    ({}, "never"),
    ({"merge": "final"}, "final"),
    ({"merge": "every_save"}, "every_save"),
    ({"merge_lora": True}, "every_save"),   # deprecated alias
    ({"merge_lora": False}, "never"),
])
def test_merge_policy(write_recipe, checkpoint, merge):
    c = R.load(write_recipe(checkpoint=checkpoint)).checkpoint
    assert c.merge == merge and c.merge_lora is (merge == "every_save")


@pytest.mark.parametrize("checkpoint,overrides,fragment", [
    ({"merge": "final", "merge_lora": True}, [], "deprecated name of checkpoint.merge and both are set"),
    ({"merge": "never"}, ["checkpoint.merge_lora=true"], "keep only checkpoint.merge"),
    ({"merge_lora": "yes"}, [], "merge_lora (deprecated) must be true or false, got 'yes'"),
    ({"merge": "sometimes"}, [], "checkpoint.merge: Input should be 'every_save', 'final' or 'never'"),
    ({"keep_local": 0}, [], "checkpoint.keep_local"),
    ({"step_time_s": -1.0}, [], "checkpoint.step_time_s"),
])
def test_merge_and_retention_keys_bad_input(write_recipe, checkpoint, overrides, fragment):
    with pytest.raises(R.RecipeError, match=re.escape(fragment)):
        R.load(write_recipe(checkpoint=checkpoint), overrides)


@pytest.mark.parametrize("merge,ok", [("every_save", False), ("final", True), ("never", True)])
def test_swift_backend_merge(write_recipe, merge, ok):
    path = write_recipe(run={"backend": "swift"}, parallel={"nproc_per_node": 1, "expert": 1},
                        checkpoint={"merge": merge})
    if ok:
        assert R.load(path).checkpoint.merge == merge
    else:
        with pytest.raises(R.RecipeError, match='use checkpoint.merge = "final"'):
            R.load(path)


def test_shipped_large_recipes_merge_once_after_training():
    for name in ("qwen3.5-397b-a17b-lora-ep8.toml", "qwen3-235b-a22b-lora-ep8.toml"):
        assert R.load(ROOT / "recipes" / name).checkpoint.merge == "final"


def test_save_steps_auto_is_accepted_and_outside_the_hash(write_recipe):
    from orchestrator.config.recipe import RecipeError, load, recipe_hash
    fixed = load(write_recipe(checkpoint={"save_steps": 100}))
    auto = load(write_recipe(checkpoint={"save_steps": "auto"}))
    assert auto.checkpoint.save_steps == "auto" and recipe_hash(auto) == recipe_hash(fixed)
    for bad in ("sometimes", 0, 2.5):
        with pytest.raises(RecipeError, match="save_steps"):
            load(write_recipe(checkpoint={"save_steps": bad}))
