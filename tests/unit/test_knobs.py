"""A llama-server knob is declared once (``supervisor/launch/knobs.py``): the config schema, a model's
override, the argv and the identity all come from that row."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
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

# A knob nobody declared: one field added to a copy of launch/knobs.py, then everything derived from it
# is read in a fresh interpreter that imports that copy.
NEW_FIELD = (
    '    batch_size: int = knob(2048, "logical batch (-b)", at_least(1), flag=("-b", "--batch-size"))\n'
)
READ_IT_BACK = textwrap.dedent(
    """
    import dataclasses, json, sys
    from pathlib import Path
    import supervisor
    from supervisor.config.load import parse_config
    from supervisor.config.models import served_models
    from supervisor.config.schema import LlamaConfig, ServedModelConfig
    from supervisor.daemon.prepare import Binary, Model, identity_for, launch_spec
    from supervisor.errors import ConfigError
    from supervisor.launch.flags import build_argv, refused_extra_args

    text = "llama: {batch_size: 1024}\\nmodels: [{name: a}, {name: b, batch_size: 512}]\\n"
    out = {
        "package": supervisor.__file__,
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


def test_a_knob_added_to_the_table_reaches_schema_overrides_argv_and_identity(tmp_path: Path) -> None:
    copy = tmp_path / "supervisor"
    shutil.copytree(ROOT / "supervisor", copy, ignore=shutil.ignore_patterns("__pycache__"))
    knobs_py = copy / "launch" / "knobs.py"
    text = knobs_py.read_text()
    anchor = "class LlamaKnobs:\n"
    assert anchor in text
    knobs_py.write_text(text.replace(anchor, anchor + NEW_FIELD, 1))
    # The copy first on the path; proxy/ (which the schema imports) from the checkout.
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-c", READ_IT_BACK],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["package"] == str(copy / "__init__.py")  # the copy with the new field was read
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


def test_the_config_classes_are_the_knobs_fields() -> None:
    """``LlamaConfig`` is the knobs plus what the child runs; a ``models[]`` entry has one override per
    per-model knob, of the knob's type or null; the loader reads each knob's doc and check."""
    by_name = {k.name: k for k in KNOBS}
    llama = {f.name: f for f in dataclasses.fields(schema.LlamaConfig)}
    assert set(llama) == set(by_name) | {"lock", "binary", "binary_sha256", "model", "state_dir"}
    hints = typing.get_type_hints(schema.LlamaConfig)
    for k in KNOBS:
        assert llama[k.name].default == k.default and llama[k.name].metadata["doc"] == k.doc
        assert llama[k.name].metadata["check"] is k.check and hints[k.name] == k.type
    served = typing.get_type_hints(schema.ServedModelConfig)
    per_model = {k.name for k in KNOBS if k.per_model}
    assert per_model <= set(served)
    for name in per_model:
        assert served[name] == by_name[name].type | None, name
    assert not {k.name for k in KNOBS if not k.per_model} & set(served)
    assert [f.name for f in dataclasses.fields(flags.LaunchSpec)] == [
        "binary",
        "model",
        "alias",
        "port",
        "llama",
        "slot_states",  # the disk tier's folder (daemon/state_disk.py), not a knob
        "swa_full",  # decided from the model and the tier (budget/window.py), not a knob
    ]
