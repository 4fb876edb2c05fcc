"""deploy/container/Containerfile: hadolint-clean, built by the README's own steps, wired to real commands.

No container engine runs in CI, so the image is never built here; what can be checked without one is.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.cli import build_parser
from supervisor.config.load import load_config

REPO = Path(__file__).resolve().parents[2]
CONTAINER = REPO / "deploy" / "container"
CONTAINERFILE = CONTAINER / "Containerfile"
BUILD_STEPS = CONTAINER / "build-steps.sh"
README = REPO / "README.md"
HADOLINT = Path(sys.executable).parent / "hadolint"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def script_commands(text: str) -> list[str]:
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith(("#", "set "))
    ]


def readme_blocks(text: str) -> list[list[str]]:
    """Command lines of the README's shell code blocks (prompts and comments removed)."""
    blocks = re.findall(r"^```(?:sh|bash|shell|console)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    out = []
    for block in blocks:
        lines = [line.strip().removeprefix("$ ") for line in block.splitlines()]
        out.append([line for line in lines if line and not line.startswith("#")])
    return out


def contains_run(haystack: list[str], needle: list[str]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


@pytest.fixture(scope="module")
def containerfile() -> str:
    return CONTAINERFILE.read_text()


def test_hadolint_passes(tmp_path: Path) -> None:
    # An empty config of our own: a stray .hadolint.yaml in a home or config folder cannot silence rules.
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")
    result = subprocess.run(
        [
            str(HADOLINT),
            "--config",
            str(config),
            "--format",
            "json",
            "--failure-threshold",
            "style",
            str(CONTAINERFILE),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    findings = json.loads(result.stdout or "[]")
    assert result.returncode == 0 and findings == [], result.stdout + result.stderr


def test_hadolint_flags_what_the_ignores_hide(tmp_path: Path, containerfile: str) -> None:
    # Proves the check above can fail: without the inline ignores hadolint does complain.
    bare = tmp_path / "Containerfile"
    bare.write_text("\n".join(line for line in containerfile.splitlines() if "hadolint ignore" not in line))
    result = subprocess.run(
        [str(HADOLINT), "--format", "json", str(bare)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and json.loads(result.stdout)


def test_every_hadolint_ignore_has_a_reason(containerfile: str) -> None:
    lines = containerfile.splitlines()
    for n, line in enumerate(lines):
        if "hadolint ignore=" in line:
            previous = lines[n - 1].strip() if n else ""
            assert previous.startswith("#") and "hadolint" not in previous, (
                f"line {n + 1}: `{line.strip()}` needs a comment line above it saying why"
            )


def test_build_stage_runs_the_shared_build_steps(containerfile: str) -> None:
    build, _final = stages(containerfile)
    runs = [args for word, args in build if word == "RUN"]
    assert "sh deploy/container/build-steps.sh" in runs
    copied = " ".join(args for word, args in build if word == "COPY")
    assert "deploy/container/build-steps.sh" in copied
    commands = script_commands(BUILD_STEPS.read_text())
    assert "llamagate build" in commands and "llamagate verify" in commands


def test_readme_documents_the_same_build_steps() -> None:
    commands = script_commands(BUILD_STEPS.read_text())
    blocks = readme_blocks(README.read_text())
    assert any(contains_run(block, commands) for block in blocks), (
        "README.md needs a shell code block with these lines, in this order (deploy/container/"
        "build-steps.sh runs them in the image):\n" + "\n".join(commands)
    )


def test_build_steps_are_real_commands() -> None:
    parser = build_parser()
    for command in script_commands(BUILD_STEPS.read_text()):
        argv = shlex.split(command)
        if argv[0] == "llamagate":
            args = parser.parse_args(argv[1:])
            assert callable(args.func), command


def test_copied_sources_exist(containerfile: str) -> None:
    for word, args in instructions(containerfile):
        if word == "COPY" and "--from=" not in args:
            for source in shlex.split(args)[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"


def test_final_stage_is_slim_non_root_and_healthchecked(containerfile: str) -> None:
    _build, final = stages(containerfile)
    words = dict(final)
    # Only the build stage's binary, package and cache come across, never its sources or toolchain.
    copies = [args for word, args in final if word == "COPY" and "--from=build" in args]
    assert sorted(shlex.split(c)[-1] for c in copies) == ["/opt/llamagate", "/var/cache/llamagate"]
    assert "build-essential" not in " ".join(args for _, args in final)
    user = words["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "a numeric non-root USER (Kubernetes runAsNonRoot checks it)"
    config_path = REPO / "deploy" / "container" / "config.yaml"
    config = load_config(config_path)
    assert words["EXPOSE"] == str(config.proxy.port)
    assert config.proxy.host == "0.0.0.0" and config.supervision.exit_on_failed
    health = json.loads(words["HEALTHCHECK"].split("CMD", 1)[1])
    assert health[:2] == ["/bin/sh", "-c"]
    status = shlex.split(health[2].split("||")[0])
    assert status[:2] == ["llamagate", "status"]
    parser = build_parser()
    assert callable(parser.parse_args([a for a in status[1:] if not a.startswith(">")]).func)
    # status asks $LLAMAGATE_URL; it must point at the port the proxy listens on.
    url = re.search(r"LLAMAGATE_URL=http://127\.0\.0\.1:(\d+)", words["ENV"])
    assert url and int(url.group(1)) == config.proxy.port
    entry = json.loads(words["ENTRYPOINT"]) + json.loads(words["CMD"])
    assert entry[0] == "llamagate" and callable(parser.parse_args(entry[1:]).func)
    assert "/models" in words["VOLUME"]


def test_every_documented_podman_build_keeps_the_healthcheck() -> None:
    """podman's default OCI format drops HEALTHCHECK and SHELL: podman builds shown pass --format docker."""
    docs = (REPO / "docs" / "deploy.md").read_text() + CONTAINERFILE.read_text()
    builds = re.findall(r"podman build[^\n]*", docs)
    assert builds, "docs/deploy.md shows how to build the image with podman"
    assert [b for b in builds if "--format docker" not in b] == []


def test_a_gpu_image_serves_its_variant_from_the_baked_config(containerfile: str, tmp_path: Path) -> None:
    """--build-arg VARIANT=vulkan: the runtime stage's sed adds the variant and GPU_LAYERS to the baked
    config's llama: section (run here as the image runs it), and the result is a valid config."""
    _build, final = stages(containerfile)
    run = next(args for word, args in final if word == "RUN" and "sed -i" in args)
    expression = re.search(r'sed -i "([^"]+)" /etc/llamagate/config\.yaml', run)
    assert expression is not None
    config = tmp_path / "config.yaml"
    config.write_text((CONTAINER / "config.yaml").read_text())
    script = expression.group(1).replace("$VARIANT", "vulkan").replace("$GPU_LAYERS", "99")
    subprocess.run(["sed", "-i", script, str(config)], check=True, timeout=30)
    cfg = load_config(config)
    assert (cfg.llama.variant, cfg.llama.gpu_layers) == ("vulkan", 99)
    assert cfg.llama.slots == load_config(CONTAINER / "config.yaml").llama.slots  # the rest as baked
    assert "--print-packages runtime" in run and 'if [ "$VARIANT" != cpu ]' in run
