"""``llama.chat_template``: a built-in name or a readable Jinja file, validated, and passed by the table."""

from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

import pytest

from supervisor.artifacts.demo_model import GEMMA, SMOLLM2
from supervisor.artifacts.lock import load_lock
from supervisor.config.load import load_config, parse_config
from supervisor.config.schema import Config
from supervisor.daemon.prepare import chat_template_for
from supervisor.errors import ConfigError
from supervisor.launch.chat_template import BUILTIN_CHAT_TEMPLATES
from supervisor.launch.flags import LaunchSpec, build_argv
from supervisor.launch.knobs import LlamaKnobs
from supervisor.paths import cache_root

REPO = Path(__file__).resolve().parents[2]
SPEC = LaunchSpec(
    binary=Path("/opt/llama-server"),
    model=Path("/m/model.gguf"),
    alias="m",
    port=41234,
    llama=LlamaKnobs(threads=2, threads_batch=2, slots=2, ctx_per_slot=4096),
)


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, env={})
    return list(info.value.problems)


def argv_for(template: str | None) -> list[str]:
    return build_argv(SPEC.with_llama(chat_template=template))


def test_a_builtin_name_is_passed_with_no_jinja() -> None:
    cfg = parse_config("llama:\n  chat_template: llama3\n", env={})
    assert cfg.llama.chat_template == "llama3"
    argv = argv_for(cfg.llama.chat_template)
    i = argv.index("--chat-template")
    # Without --no-jinja llama-server would render the word "llama3" as the whole prompt.
    assert argv[i + 1] == "llama3" and "--no-jinja" in argv
    assert "--chat-template-file" not in argv


def test_a_template_file_is_relative_to_the_config_and_rendered_by_jinja(tmp_path: Path) -> None:
    (tmp_path / "tmpl.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config = tmp_path / "config.yaml"
    config.write_text("llama:\n  chat_template: tmpl.jinja\n")
    cfg = load_config(config)
    assert cfg.llama.chat_template == str(tmp_path / "tmpl.jinja")
    argv = argv_for(cfg.llama.chat_template)
    assert argv[argv.index("--chat-template-file") + 1] == str(tmp_path / "tmpl.jinja")
    assert "--chat-template" not in argv and "--no-jinja" not in argv


def test_null_passes_nothing_and_the_gguf_template_is_used() -> None:
    argv = argv_for(None)
    assert not {"--chat-template", "--chat-template-file", "--no-jinja", "--jinja"} & set(argv)


def test_an_unknown_name_is_refused_with_a_suggestion_and_the_list() -> None:
    (problem,) = problems("llama:\n  chat_template: gema\n")
    assert problem.startswith("llama.chat_template: 'gema' is neither a built-in template name")
    assert "(did you mean gemma?)" in problem and "chatml, llama2," in problem


def test_a_missing_file_or_a_folder_is_refused(tmp_path: Path) -> None:
    (problem,) = problems(f"llama:\n  chat_template: {tmp_path / 'nope.jinja'}\n")
    assert problem.startswith("llama.chat_template: 'nope.jinja' is neither") and str(tmp_path) in problem
    (problem,) = problems(f"llama:\n  chat_template: {tmp_path}\n")
    assert problem == f"llama.chat_template: {tmp_path} is not a file"
    assert problems("llama:\n  chat_template: ''\n") == [
        "llama.chat_template: must be a built-in name or a file path (got '')"
    ]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret.jinja"
    path.write_text("x")
    path.chmod(0)
    assert problems(f"llama:\n  chat_template: {path}\n") == [
        f"llama.chat_template: template file {path} is not readable"
    ]


@pytest.mark.parametrize("flag", ["--chat-template", "--chat-template-file", "--jinja", "--no-jinja"])
def test_extra_args_cannot_set_the_template_behind_the_setting(flag: str) -> None:
    (problem,) = problems(f"llama:\n  extra_args: [{flag}, x]\n")
    assert problem.startswith(f"llama.extra_args[0]: {flag} is not allowed")


def test_the_gemma_demo_model_gets_gemma_and_every_other_model_its_own_template(tmp_path: Path) -> None:
    # The default demo model (SmolLM2 Instruct) has its own template in its GGUF.
    assert chat_template_for(Config()) is None
    own = parse_config(f"llama:\n  model: {{path: {tmp_path / 'm.gguf'}, sha256: '{'a' * 64}'}}\n", env={})
    assert chat_template_for(own) is None
    smol = parse_config(
        f"llama:\n  model: {{path: {tmp_path / 's.gguf'}, sha256: '{SMOLLM2.sha256}'}}\n", env={}
    )
    assert chat_template_for(smol) is None
    # Gemma 3's GGUF has none: its family's format, recognised by the file's digest wherever it is.
    gemma = parse_config(
        f"llama:\n  model: {{path: {tmp_path / 'd.gguf'}, sha256: '{GEMMA.sha256}'}}\n", env={}
    )
    assert chat_template_for(gemma) == "gemma"
    chosen = parse_config("llama:\n  chat_template: chatml\n", env={})
    assert chat_template_for(chosen) == "chatml"


def test_the_names_are_the_pinned_sources_list() -> None:
    """Compared with ``LLM_CHAT_TEMPLATES`` in the source tarball that ``llamagate build`` caches."""
    lock = load_lock(REPO / "llama-build.lock")
    tarball = cache_root() / "sources" / lock.sources[0].sha256
    if not tarball.is_file():
        pytest.skip(f"the pinned source is not cached yet ({tarball}); `llamagate build` fetches it")
    with tarfile.open(tarball) as tar:
        # Iterating stops at the member instead of indexing all of the 76 MB archive first.
        member = next(m for m in tar if m.name.endswith("vendor/llama.cpp/src/llama-chat.cpp"))
        fh = tar.extractfile(member)
        assert fh is not None
        text = fh.read().decode()
    table = text.split("LLM_CHAT_TEMPLATES = {", 1)[1].split("};", 1)[0]
    assert tuple(re.findall(r'\{\s*"([^"]+)"', table)) == BUILTIN_CHAT_TEMPLATES
