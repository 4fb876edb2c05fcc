"""The child's argv and environment come from one table; nothing leaks in from our environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.launch.flags import (
    FLAGS,
    LaunchSpec,
    build_argv,
    build_env,
    new_secret,
    owned_flags,
    refused_extra_args,
)
from supervisor.launch.knobs import LlamaKnobs

SPEC = LaunchSpec(
    binary=Path("/opt/llama-server"),
    model=Path("/m/model.gguf"),
    alias="gemma",
    port=41234,
    llama=LlamaKnobs(threads=4, threads_batch=6, slots=3, ctx_per_slot=4096),
)


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_argv_sets_every_value_the_supervisor_cares_about() -> None:
    argv = build_argv(SPEC)
    assert argv[0] == "/opt/llama-server"
    assert flag_value(argv, "-m") == "/m/model.gguf"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "41234"
    assert flag_value(argv, "-c") == str(3 * 4096)  # total context
    assert flag_value(argv, "-np") == "3"
    assert flag_value(argv, "-t") == "4"
    assert flag_value(argv, "-tb") == "6"
    assert flag_value(argv, "-ngl") == "0"
    assert flag_value(argv, "-a") == "gemma"
    assert flag_value(argv, "-ctk") == "f16" and flag_value(argv, "-ctv") == "f16"
    assert "--metrics" in argv and "--no-ui" in argv
    assert "--embeddings" not in argv


def test_embeddings_and_extra_args() -> None:

    argv = build_argv(SPEC.with_llama(embeddings=True, extra_args=("--temp", "0.5")))
    assert "--embeddings" in argv
    assert argv[-2:] == ["--temp", "0.5"]


def test_secret_is_in_the_environment_not_argv(tmp_path: Path) -> None:
    secret = new_secret()
    argv = build_argv(SPEC)
    env = build_env(secret, tmp_path)
    assert secret not in " ".join(argv)
    assert "--api-key" not in argv
    assert env["LLAMA_API_KEY"] == secret
    assert len(secret) >= 40 and new_secret() != secret


def test_environment_is_scrubbed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_ARG_N_PARALLEL", "16")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("LD_PRELOAD", "/evil.so")
    env = build_env("s", tmp_path)
    assert set(env) == {"PATH", "HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "LANG", "LLAMA_API_KEY"}
    assert env["XDG_CONFIG_HOME"].startswith(str(tmp_path))
    assert env["HOME"] == str(tmp_path)


def test_every_spelling_of_an_owned_flag_is_refused() -> None:
    owned = owned_flags()
    for flag in FLAGS:
        for name in flag.names:
            assert name in owned
    bad = refused_extra_args(("--ctx-size=8192", "--temp", "0.1", "--parallel", "8", "--api-key-file", "k"))
    assert [(i, name) for i, name, _ in bad] == [(0, "--ctx-size"), (3, "--parallel"), (5, "--api-key-file")]


def test_the_prompt_cache_and_checkpoints_are_set_not_left_to_llama_server() -> None:
    # Its defaults (8 GiB of prompt cache, 32 checkpoints per slot) are memory the budget cannot see.

    argv = build_argv(SPEC.with_llama(prompt_cache_mib=128, ctx_checkpoints=4))
    assert flag_value(argv, "--cache-ram") == "128"
    assert flag_value(argv, "--ctx-checkpoints") == "4"
    bad = refused_extra_args(("-cram", "-1", "--swa-checkpoints=64"))
    assert [(i, name) for i, name, _ in bad] == [(0, "-cram"), (2, "--swa-checkpoints")]


def test_memory_flags_in_extra_args_are_read_for_the_budget() -> None:
    from supervisor.launch.flags import budget_flags

    assert budget_flags(()) == (False, 512)
    assert budget_flags(("--swa-full", "-ub", "1024")) == (True, 1024)
    assert budget_flags(("--ubatch-size=256",)) == (False, 256)
