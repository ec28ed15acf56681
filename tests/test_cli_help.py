"""Every flag and positional of every `metrale` subcommand explains itself in --help
(meaning, default, allowed values), as vLLM users expect of `serve --help`."""

from __future__ import annotations

import argparse

from metrale.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, prog: str = "metrale"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            # each subcommand's one-line help, shown in the parent's --help
            missing += [c.dest for c in action._choices_actions if not (c.help or "").strip()]
            continue
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            missing.append("/".join(action.option_strings) or action.dest)
    return missing


def test_every_cli_argument_has_help():
    missing = {prog: m for prog, p in _parsers(build_parser()) if (m := _undocumented(p))}
    assert not missing, f"arguments without help: {missing}"


def test_serve_help_names_defaults_and_choices():
    serve = dict(_parsers(build_parser()))["metrale serve"]
    text = serve.format_help()
    for expected in ("127.0.0.1", "8000", "2048", "bfloat16", "cuda"):
        assert expected in text


def test_serve_lora_extra_targets_flag():
    """--lora-extra-targets parses a comma list into EngineConfig's canonical tuple and
    refuses unknown names at parse time, naming the choices."""
    import pytest

    from metrale.config import ConfigError, EngineConfig, PoolConfig

    serve = dict(_parsers(build_parser()))["metrale serve"]
    assert "embed_tokens" in serve.format_help() and "lm_head" in serve.format_help()
    args = serve.parse_args(["--lora-extra-targets", "lm_head,embed_tokens"])
    assert args.lora_extra_targets == ("embed_tokens", "lm_head")
    assert serve.parse_args([]).lora_extra_targets == ()
    with pytest.raises(SystemExit):
        serve.parse_args(["--lora-extra-targets", "wte"])
    cfg = EngineConfig(lora_extra_targets=("lm_head",))
    assert cfg.pool.extra_targets == ("lm_head",)
    with pytest.raises(ConfigError, match="choose from"):
        EngineConfig(lora_extra_targets=("q_proj",))
    with pytest.raises(ConfigError, match="disagrees"):
        EngineConfig(pool=PoolConfig(extra_targets=("lm_head",)),
                     lora_extra_targets=("embed_tokens",))


def test_scheduler_flags_reach_the_config_and_bad_values_are_refused():
    """serve's scheduling flags become SchedulerConfig fields; non-positive caps and
    negative PoolConfig byte budgets are refused at construction."""
    import pytest

    from metrale.config import ConfigError, PoolConfig, SchedulerConfig

    serve = dict(_parsers(build_parser()))["metrale serve"]
    args = serve.parse_args(["--max-prefill-attention", "262144", "--max-prefill-chunk", "64"])
    assert (args.max_prefill_attention, args.max_prefill_chunk) == (262144, 64)
    assert serve.parse_args([]).max_prefill_attention is None
    assert serve.parse_args(["--step-time-ratio", "0"]).step_time_ratio == 0  # off
    assert serve.parse_args([]).step_time_ratio == SchedulerConfig().step_time_ratio
    for bad in ("1", "0.5", "nan", "-2"):
        with pytest.raises(SystemExit):
            serve.parse_args(["--step-time-ratio", bad])
    for bad in (dict(max_prefill_attention=0), dict(max_prefill_chunk=-1),
                dict(max_promotions_in_flight=0), dict(max_admission_wait_s=float("nan"))):
        with pytest.raises(ConfigError):
            SchedulerConfig(**bad)
    with pytest.raises(ConfigError, match="mapped_file_bytes"):
        PoolConfig(mapped_file_bytes=-1)
