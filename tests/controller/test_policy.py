"""Policy files, command-line overrides and validation messages."""

from __future__ import annotations

import re

import pytest

from taskd_core.controller.policy import load_policies, parse_strategies, updated_policy, validated
from taskd_core.errors import ConfigError
from taskd_core.models import JobPolicy, SlowRankPolicy, Strategy


def test_strategies_are_deduplicated_and_put_in_ladder_order():
    assert parse_strategies("exit, recover,retry,recover") == (
        Strategy.RETRY,
        Strategy.RECOVER,
        Strategy.EXIT,
    )
    assert parse_strategies([Strategy.DUMP, "recover-in-place"]) == (Strategy.RECOVER_IN_PLACE, Strategy.DUMP)


def test_file_defaults_flags_and_job_tables_layer_in_that_order(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(
        '[defaults]\nstrategies = ["recover", "exit"]\nreport_timeout = 30\nmax_cycles = 2\n'
        '[jobs."job-a"]\nstrategies = "dump,exit"\nrecovery = false\n'
    )
    book = load_policies(path, max_cycles=9)
    assert book.defaults.strategies == (Strategy.RECOVER, Strategy.EXIT)
    assert (book.defaults.report_timeout, book.defaults.max_cycles) == (30, 9)
    job = book.for_job("job-a")
    assert (
        job.strategies == (Strategy.DUMP, Strategy.EXIT) and not job.recovery_enabled and job.max_cycles == 9
    )
    assert book.for_job("other") == book.defaults


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[defaults]\nstrategies = ["teleport"]\n', r"\[defaults\] strategies: unknown strategy 'teleport'"),
        ("[defaults]\nreport_timeout = 0\n", r"\[defaults\] report_timeout: must be greater than 0"),
        ("[defaults]\nmax_cycles = 1.5\n", r"max_cycles: expected an integer"),
        ('[defaults]\nrecovery = "yes"\n', r"recovery: expected true or false"),
        ("[defaults]\nflush = 1\n", r"\[defaults\] flush: unknown policy key; known keys: strategies"),
        ('[jobs."j"]\nexpected_agents = -1\n', r'\[jobs."j"\] expected_agents: must be at least 0'),
        ("[default]\n", r"unknown table\(s\) default"),
        ("[defaults\n", r"not valid TOML"),
    ],
)
def test_bad_policy_files_name_the_key_and_the_fix(tmp_path, text, message):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_policies(path)


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_policies(tmp_path / "nope.toml")


def test_policies_built_in_code_are_validated():
    assert validated(JobPolicy(strategies=("recover", "exit"))).strategies == (
        Strategy.RECOVER,
        Strategy.EXIT,
    )  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="flush_seconds"):
        updated_policy(JobPolicy(), {"flush_seconds": float("nan")})


def test_slow_rank_settings_come_from_the_file_per_job(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(
        '[defaults]\nslow_rank_bound = 1.8\n[jobs."a"]\nslow_rank = "warn"\nslow_rank_window = 40\n'
    )
    book = load_policies(path)
    assert (book.defaults.slow_rank, book.defaults.slow_rank_bound, book.defaults.slow_rank_window) == (
        SlowRankPolicy.WARN,
        1.8,
        20,
    )
    assert (book.for_job("a").slow_rank_bound, book.for_job("a").slow_rank_window) == (1.8, 40)
    # Not given, it is 0: learned from the job's own ratios.
    assert load_policies().defaults.slow_rank_bound == 0.0
    path.write_text("[defaults]\nslow_rank_bound = 0\n")
    assert load_policies(path).defaults.slow_rank_bound == 0.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('slow_rank = "evict"', "slow_rank: expected one of 'warn', 'replace'"),
        ("slow_rank_bound = 1.0", "slow_rank_bound: must be greater than 1, or 0 to learn it from the job"),
        ("slow_rank_bound = -1", "slow_rank_bound: must be greater than 1, or 0"),
        ('slow_rank_bound = "x"', "slow_rank_bound: expected a number"),
        ("slow_rank_window = 2", "slow_rank_window: must be at least 4"),
        ("slow_rank_window = 5000", "slow_rank_window: must be at most 1000 steps"),
        ("slow_rank_window = 7.5", "slow_rank_window: expected an integer"),
    ],
)
def test_bad_slow_rank_settings_name_the_key(tmp_path, text, message):
    path = tmp_path / "policy.toml"
    path.write_text(f"[defaults]\n{text}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_policies(path)
