"""A llama-server knob is declared once (``supervisor/launch/knobs.py``): the config schema, a model's
override, the argv and the identity all come from that row."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

from supervisor.config import schema
from supervisor.config.load import parse_config
from supervisor.config.models import served_models
from supervisor.daemon.prepare import Binary, Model, identity_for, launch_spec
from supervisor.launch import flags
from supervisor.launch.flags import build_argv
from supervisor.launch.knobs import KNOBS

ROOT = Path(__file__).resolve().parents[2]

# A knob nobody declared: added to the table in a fresh interpreter, before anything derives from it.
ADD_A_KNOB = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from supervisor.checks import at_least
    from supervisor.launch import knobs

    knobs.KNOBS = knobs.KNOBS + (
        knobs.Knob("batch_size", int, 2048, "logical batch (-b)", at_least(1), flag=("-b", "--batch-size")),
    )

    import dataclasses
    from supervisor.config.load import parse_config
    from supervisor.config.models import served_models
    from supervisor.config.rules import cross_check
    from supervisor.config.schema import LlamaConfig, ServedModelConfig
    from supervisor.daemon.prepare import Binary, Model, identity_for, launch_spec
    from supervisor.errors import ConfigError
    from supervisor.launch.flags import build_argv, refused_extra_args

    text = "llama: {batch_size: 1024}\\nmodels: [{name: a}, {name: b, batch_size: 512}]\\n"
    out = {
        "schema": {f.name: f.default for f in dataclasses.fields(LlamaConfig) if f.name == "batch_size"},
        "override": [f.name for f in dataclasses.fields(ServedModelConfig) if f.name == "batch_size"],
        "refused": [r[1] for r in refused_extra_args(("--batch-size=9",))],
        "argv": {}, "identity": {},
    }
    for served in served_models(parse_config(text)):
        spec = launch_spec(served.cfg, Binary(Path("/b"), "", None), Model(Path("/m"), "", 1, None))
        argv = build_argv(spec)
        out["argv"][served.name] = argv[argv.index("-b") + 1]
        out["identity"][served.name] = identity_for(spec, Binary(Path("/b"), "", None),
                                                    Model(Path("/m"), "", 1, None))["serving"]["batch_size"]
    try:
        parse_config("models: [{name: a, batch_size: 0}]")
    except ConfigError as exc:
        out["bad"] = str(exc)
    print(json.dumps(out))
    """
)


def test_a_knob_added_to_the_table_reaches_schema_overrides_argv_and_identity() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ADD_A_KNOB], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["schema"] == {"batch_size": 2048}  # the llama: section, with the row's default
    assert out["override"] == ["batch_size"]  # a models[] entry may set it
    assert out["argv"] == {"a": "1024", "b": "512"}  # inherited, and overridden for one model
    assert out["identity"] == {"a": 1024, "b": 512}
    assert out["refused"] == ["--batch-size"]  # the supervisor owns it: not in extra_args
    assert "models[0].batch_size: must be >= 1" in out["bad"]  # the row's check, by the operator's path


def test_gpu_layers_and_ctx_checkpoints_can_be_set_per_model() -> None:
    cfg = parse_config(
        "llama: {gpu_layers: 1, ctx_checkpoints: 4}\n"
        "models: [{name: a}, {name: b, gpu_layers: 3, ctx_checkpoints: 2}]\n"
    )
    argv = {}
    for served in served_models(cfg):
        spec = launch_spec(served.cfg, Binary(Path("/b"), "", None), Model(Path("/m"), "", 1, None))  # type: ignore[arg-type]
        args = build_argv(spec)
        argv[served.name] = (args[args.index("-ngl") + 1], args[args.index("--ctx-checkpoints") + 1])
    assert argv == {"a": ("1", "4"), "b": ("3", "2")}


def test_the_identity_names_every_identity_knob() -> None:
    served = served_models(parse_config("llama: {threads: 3, extra_args: [--temp, '0.5']}"))[0]
    spec = launch_spec(served.cfg, Binary(Path("/b"), "", None), Model(Path("/m"), "", 1, None))  # type: ignore[arg-type]
    serving = identity_for(spec, Binary(Path("/b"), "", None), Model(Path("/m"), "", 1, None))["serving"]  # type: ignore[arg-type]
    assert isinstance(serving, dict)
    assert set(serving) == {k.name for k in KNOBS if k.identity}
    assert serving["threads"] == 3 and serving["threads_batch"] == 3  # resolved, as the child got them
    assert serving["extra_args"] == ["--temp", "0.5"]  # plain JSON
    json.dumps(serving)


def _checker_view(module: Path, name: str) -> dict[str, str]:
    """The annotations of the class ``name`` declared under ``if TYPE_CHECKING:`` in ``module``."""
    tree = ast.parse(module.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for cls in node.body:
                if isinstance(cls, ast.ClassDef) and cls.name == name:
                    return {
                        s.target.id: ast.unparse(s.annotation)
                        for s in cls.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    }
    raise AssertionError(f"no TYPE_CHECKING class {name} in {module}")


def test_the_type_checkers_views_agree_with_the_table() -> None:
    by_name = {k.name: k for k in KNOBS}
    namespace = vars(schema)
    llama = _checker_view(ROOT / "supervisor/config/schema.py", "LlamaConfig")
    assert llama and set(llama) <= set(by_name)
    for name, annotation in llama.items():
        assert eval(annotation, namespace) == by_name[name].type, name
    served = _checker_view(ROOT / "supervisor/config/schema.py", "ServedModelConfig")
    for name, annotation in served.items():
        assert by_name[name].per_model
        assert eval(annotation, namespace) == by_name[name].type | None, name
    spec = _checker_view(ROOT / "supervisor/launch/flags.py", "LaunchSpec")
    fixed = {"binary", "model", "alias", "port", "slot_states", "__dataclass_fields__"}
    assert set(spec) - fixed <= set(by_name)
    # At run time every knob is a field of each, with the row's default (the schema's with its doc).
    fields = {f.name: f for f in dataclasses.fields(schema.LlamaConfig)}
    spec_fields = {f.name: f for f in dataclasses.fields(flags.LaunchSpec)}
    for k in KNOBS:
        assert fields[k.name].default == k.default and fields[k.name].metadata["doc"] == k.doc
        assert typing.get_type_hints(schema.LlamaConfig)[k.name] == k.type
        assert spec_fields[k.name].default == k.default
