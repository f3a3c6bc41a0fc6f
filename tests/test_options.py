"""Options are declared once (a config dataclass field) and reach LLM, the CLI and the docs."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re

import pytest

from kvflow import envs, options
from kvflow.config import SchedulerConfig, option
from kvflow.entrypoints.serve_cli import register as register_serve
from kvflow.entrypoints.serve_cli import server_settings
from kvflow.options import (OPTIONS, add_engine_args, engine_config, engine_kwargs,
                            expand_dotted_flags)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one `kvflow` subcommand (`bench`: bench throughput), as main() builds it."""
    from kvflow.entrypoints.cli import build_parser

    def sub(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[name]

    p = sub(build_parser(), command)
    return sub(p, "throughput") if command == "bench" else p


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_every_option_is_a_flag_of_every_engine_command(command):
    p = cli_parser(command)
    flags = {s for a in p._actions for s in a.option_strings}
    for o in OPTIONS.values():
        assert o.flag in flags, f"{command} lacks {o.flag}"
    args = p.parse_args([])
    kwargs = engine_kwargs(args)
    assert set(kwargs) == set(OPTIONS)
    expected = dict((name, o.default) for name, o in OPTIONS.items())
    if command == "serve":
        expected["max_num_batched_tokens"] = 1024  # the server's own default, said in the table
    assert kwargs == expected


def test_flags_reach_the_engine_config_as_llm_keywords_do():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = ["--dtype", "float32", "--max-num-seqs", "7", "--kv-cache-dtype", "bfloat16",
            "--no-enable-prefix-caching", "--scheduling-policy", "priority", "-tp", "1",
            "--seed", "11", "--served-model-name", "a", "b", "--num-threads", "2"]
    from_flags = engine_config(**engine_kwargs(p.parse_args(argv)))
    from_kwargs = engine_config(dtype="float32", max_num_seqs=7, kv_cache_dtype="bfloat16",
                                enable_prefix_caching=False, scheduling_policy="priority",
                                tensor_parallel_size=1, seed=11, served_model_name=["a", "b"],
                                num_threads=2)
    assert from_flags == from_kwargs
    assert from_flags.scheduler_config.policy == "priority"
    assert from_flags.cache_config.cache_dtype == "bfloat16"
    assert from_flags.model_config.seed == 11


def test_a_field_added_to_a_config_becomes_a_flag_and_a_keyword(monkeypatch):
    Extended = dataclasses.make_dataclass(
        "Extended", [("spec_tokens", int, option(3, "draft tokens per step"))], bases=(SchedulerConfig,))
    monkeypatch.setitem(options.SECTIONS, "scheduler_config", Extended)
    monkeypatch.setattr(options, "OPTIONS", options._collect())
    assert options.OPTIONS["spec_tokens"].default == 3
    p = argparse.ArgumentParser()
    options.add_engine_args(p)
    args = p.parse_args(["--spec-tokens", "5"])
    config = options.engine_config(**options.engine_kwargs(args))
    assert config.scheduler_config.spec_tokens == 5
    assert options.engine_config(spec_tokens=4).scheduler_config.spec_tokens == 4
    assert "`--spec-tokens`" in options.markdown_table()


def test_unknown_llm_keyword_names_the_closest_option():
    from kvflow.entrypoints.llm import LLM

    with pytest.raises(TypeError, match="'max_num_seq'.*did you mean 'max_num_seqs'"):
        LLM(max_num_seq=4)
    with pytest.raises(TypeError, match="unknown option 'zzz'; valid options: "):
        engine_config(zzz=1)
    with pytest.raises(TypeError, match="did you mean 'kv_cache_dtype'"):
        engine_config(kv_cache_dtyp="bfloat16")


def test_a_bad_value_names_its_option():
    with pytest.raises(ValueError, match="block_size"):
        engine_config(block_size=3)
    with pytest.raises(ValueError, match="num_threads"):
        engine_config(num_threads=0)
    with pytest.raises(ValueError, match="seed"):
        engine_config(seed=-1)


def test_num_threads_defaults_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVFLOW_NUM_THREADS", "3")
    assert engine_config().num_threads == 3
    assert engine_config(num_threads=2).num_threads == 2
    monkeypatch.delenv("KVFLOW_NUM_THREADS")
    assert engine_config().num_threads == 1


def test_server_options_and_served_names_come_from_their_fields(monkeypatch):
    monkeypatch.delenv("KVFLOW_API_KEY", raising=False)
    root = argparse.ArgumentParser()
    register_serve(root.add_subparsers())
    args = root.parse_args(["serve", "--port", "8123", "--max-body-size", "1MiB",
                            "--served-model-name", "one", "two", "--access-log"])
    settings = server_settings(args, engine_config(**engine_kwargs(args)))
    assert (settings.port, settings.max_body_size, settings.access_log) == (8123, 2**20, True)
    assert settings.served_model_names == ["one", "two"] and settings.api_key is None
    args = root.parse_args(["serve"])
    monkeypatch.setenv("KVFLOW_API_KEY", "k")
    settings = server_settings(args, engine_config(**engine_kwargs(args)))
    assert settings.served_model_names == ["SmolLM2-135M-Instruct"] and settings.api_key == "k"
    assert settings.enable_prompt_tokens_details is False  # off: cache hits are a side channel
    args = root.parse_args(["serve", "--enable-prompt-tokens-details"])
    assert server_settings(args, engine_config(**engine_kwargs(args))).enable_prompt_tokens_details


def test_configuration_page_options_table_is_the_generated_one():
    with open(os.path.join(ROOT, options.DOCS_PAGE)) as f:
        text = f.read()
    assert options.render_table_into(text) == text, "run `python -m kvflow.options`"


def test_environment_page_is_the_generated_one():
    with open(os.path.join(ROOT, "docs", "environment.md")) as f:
        assert f.read() == envs.DOCS_HEADER + envs.markdown_table() + "\n", \
            "run `python -m kvflow.envs docs/environment.md`"


def test_environment_variables_are_read_only_through_envs():
    """No module but kvflow/envs.py reads a KVFLOW_ variable, and every one it names is declared."""
    used = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "kvflow")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                src = f.read()
            if name == "envs.py":
                continue
            assert not re.search(r"environ(\.get)?[\[(]\s*['\"]KVFLOW_", src), path
            assert not re.search(r"getenv\(\s*['\"]KVFLOW_", src), path
            used |= set(re.findall(r"envs\.(KVFLOW_[A-Z0-9_]+)", src))
    assert used <= set(envs.ENV_VARS), used - set(envs.ENV_VARS)


def test_environment_values_are_parsed_and_checked(monkeypatch):
    monkeypatch.setenv("KVFLOW_HUGEPAGES", "0")
    assert envs.KVFLOW_HUGEPAGES is False
    monkeypatch.setenv("KVFLOW_HUGEPAGES", "yes")
    assert envs.KVFLOW_HUGEPAGES is True
    monkeypatch.setenv("KVFLOW_HUGEPAGES", "maybe")
    with pytest.raises(ValueError, match="KVFLOW_HUGEPAGES"):
        envs.KVFLOW_HUGEPAGES
    monkeypatch.setenv("KVFLOW_DIST_TIMEOUT", "2.5")
    assert envs.KVFLOW_DIST_TIMEOUT == 2.5
    monkeypatch.setenv("KVFLOW_CACHE_DIR", "/x/y")
    assert envs.cache_dir() == "/x/y"
    with pytest.raises(AttributeError):
        envs.KVFLOW_NOT_DECLARED


@pytest.mark.slow
def test_seed_fixes_unseeded_sampling():
    """`seed` (--seed) seeds the engine's random state: two engines with one seed sample the
    same tokens for requests that carry no seed of their own; another seed samples others."""
    from kvflow.entrypoints.llm import LLM
    from kvflow.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True)
    runs = []
    for seed in (1, 1, 2):
        llm = LLM(seed=seed, num_blocks=64, max_model_len=256, dtype="float32")
        runs.append(llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids)
        llm.engine.shutdown()
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.slow
def test_tokenizer_option_loads_the_tokenizer_from_there(default_model_path):
    from kvflow.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="tokenizer"):
        LLM(tokenizer="/nonexistent/tok", num_blocks=16)
    llm = LLM(tokenizer=default_model_path, num_blocks=64, max_model_len=128)
    assert llm.tokenizer.encode("Hello") == llm.engine.tokenizer.encode("Hello")
    llm.engine.shutdown()


def test_dotted_flags_merge_into_the_json_option():
    assert expand_dotted_flags(["serve", "--limit-mm-per-prompt.image", "4", "--port", "1"]) == \
        ["serve", "--limit-mm-per-prompt", '{"image": 4}', "--port", "1"]
    # the JSON form and dotted keys merge in order, at the option's first place
    assert expand_dotted_flags(["--limit-mm-per-prompt", '{"image": 2}', "-x",
                                "--limit-mm-per-prompt.image=3"]) == \
        ["--limit-mm-per-prompt", '{"image": 3}', "-x"]
    assert expand_dotted_flags(["--speculative-config.method", "ngram",
                                "--speculative-config.a.b", "x"]) == \
        ["--speculative-config", '{"method": "ngram", "a": {"b": "x"}}']
    plain = ["--limit-mm-per-prompt", '{"image": 2}', "--model.x", "1"]  # not a JSON option
    assert expand_dotted_flags(plain) == plain
    with pytest.raises(ValueError, match="limit-mm-per-prompt.image: expected a value"):
        expand_dotted_flags(["--limit-mm-per-prompt.image"])
    with pytest.raises(ValueError, match="must be a JSON object"):
        expand_dotted_flags(["--limit-mm-per-prompt", "[1]", "--limit-mm-per-prompt.image", "1"])
