"""What the model takes beside text (``proxy.source.ModelInputs``) is read from the child at load, carried
on the snapshot the daemon hands the proxy, and checked at the door (``proxy.schema.media``): a media part
a model without a projector cannot take is a 400 naming the part, ``/infill`` on a model without FIM
tokens a 404; unknown (an older child) passes everything, as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.errors import NotFound
from proxy.schema import FieldError
from proxy.schema.media import check_inputs, media_parts
from proxy.source import ModelInputs
from supervisor.child import probes
from supervisor.child.machine import State
from tests.unit.test_process_driver import FakeOs, FakeProbes, make, start

TEXT_ONLY = ModelInputs()
VISION = ModelInputs(vision=True)
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
B64 = {"type": "base64", "media_type": "image/png", "data": "AAAA"}


# --- the door ---------------------------------------------------------------------------------------------

CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("chat", {"messages": [{"role": "user", "content": ["hi", IMAGE]}]}, "messages[0].content[1]", "image"),
    ("chat", {"messages": [{"role": "user", "content": [AUDIO]}]}, "messages[0].content[0]", "audio"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
        "video",
    ),
    (
        "messages",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": B64}],
                }
            ]
        },
        "messages[0].content[1]",
        "image",
    ),
    (
        "messages",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "image", "source": B64}],
                        }
                    ],
                }
            ]
        },
        "messages[0].content[0].content[0]",
        "image",
    ),
    (
        "count_tokens",
        {"messages": [{"role": "user", "content": [{"type": "image", "source": B64}]}]},
        "messages[0].content[0]",
        "image",
    ),
    (
        "responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
        "input[0].content[0]",
        "image",
    ),
    (
        "responses",
        {
            "input": [
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image", "image_url": "x"}],
                }
            ]
        },
        "input[0].output[0]",
        "image",
    ),
    (
        "completion",
        {"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}},
        "prompt.multimodal_data",
        "multimodal",
    ),
    (
        "completions",
        {"prompt": ["a", {"prompt_string": "x", "multimodal_data": []}]},
        "prompt[1].multimodal_data",
        "multimodal",
    ),
    (
        "embeddings",
        {"input": [{"prompt_string": "x", "multimodal_data": ["AAAA"]}]},
        "input[0].multimodal_data",
        "multimodal",
    ),
]


@pytest.mark.parametrize(("schema", "body", "path", "word"), CASES)
def test_a_media_part_to_a_text_only_model_is_a_400_naming_the_part(
    schema: str, body: dict[str, Any], path: str, word: str
) -> None:
    with pytest.raises(FieldError) as caught:
        check_inputs(schema, body, TEXT_ONLY, "smol")
    err = caught.value
    assert err.status == 400 and err.param == path
    assert f"takes no {word} input" in str(err) and "'smol'" in str(err)


@pytest.mark.parametrize(("schema", "body", "path", "word"), CASES)
def test_unknown_inputs_pass_everything_as_before(
    schema: str, body: dict[str, Any], path: str, word: str
) -> None:
    check_inputs(schema, body, None, "smol")


def test_a_model_with_a_projector_takes_what_it_says() -> None:
    chat = {"messages": [{"role": "user", "content": [IMAGE]}]}
    check_inputs("chat", chat, VISION, "m")
    check_inputs("completion", {"prompt": {"prompt_string": "x", "multimodal_data": ["A"]}}, VISION, "m")
    with pytest.raises(FieldError):  # vision, not audio
        check_inputs("chat", {"messages": [{"role": "user", "content": [AUDIO]}]}, VISION, "m")


def test_text_parts_and_strings_are_never_media() -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "image_url"}]}, {"content": "x"}]
    }
    assert list(media_parts("chat", body)) == []
    assert list(media_parts("completion", {"prompt": [1, 2, 3]})) == []


def test_infill_without_fim_tokens_is_a_404_as_a_route_the_model_lacks() -> None:
    body = {"input_prefix": "def f():", "input_suffix": ""}
    with pytest.raises(NotFound) as caught:
        check_inputs("infill", body, TEXT_ONLY, "smol")
    assert caught.value.status == 404 and "fill-in-the-middle" in str(caught.value)
    check_inputs("infill", body, ModelInputs(fim=True), "smol")
    check_inputs("infill", body, None, "smol")


# --- read from the child ----------------------------------------------------------------------------------


def _child(props: tuple[int, Any], infill: int) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer s"
        if request.url.path == "/props":
            return httpx.Response(props[0], json=props[1])
        assert request.url.path == "/infill" and request.content == b'{"input_extra":0}'
        return httpx.Response(infill, json={"error": {"code": infill}})

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


@pytest.mark.parametrize(
    ("props", "infill", "expected"),
    [
        # The pinned server: modalities, and /infill's own check of the vocabulary's FIM tokens.
        ((200, {"modalities": {"vision": False, "audio": False, "video": False}}), 501, TEXT_ONLY),
        (
            (200, {"modalities": {"vision": True, "audio": True, "video": False}}),
            400,
            ModelInputs(True, True, False, True),
        ),
        # Not the pinned server's answers: unknown, so the door lets every part through as before.
        ((200, {"total_slots": 1}), 501, None),
        ((404, {}), 404, None),
        ((200, {"modalities": {}}), 404, None),
    ],
)
async def test_the_inputs_are_read_from_props_and_infill(
    props: tuple[int, Any], infill: int, expected: ModelInputs | None
) -> None:
    async with _child(props, infill) as client:
        assert await probes.get_inputs(client, "http://child", "s") == expected


async def test_a_child_that_does_not_answer_is_unknown() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        assert await probes.get_inputs(client, "http://child", "s") is None


async def test_the_gate_reads_them_and_the_snapshot_carries_them(tmp_path: Path) -> None:
    os_, fake = FakeOs(), FakeProbes()
    fake.model_inputs = ModelInputs(vision=True)
    sup = make(os_, fake, tmp_path)
    assert sup.snapshot().inputs is None
    await start(sup)
    assert sup.state is State.READY
    assert sup.snapshot().inputs == ModelInputs(vision=True)


# --- the one entry of every route ---------------------------------------------------------------------------


def _check(schema: str, body: dict[str, Any], inputs: ModelInputs | None) -> None:
    from proxy.schema import check_request
    from proxy.settings import ProxySettings, TenantSettings
    from tests.fakes.fake_upstream import snapshot_for

    tenant = TenantSettings(name="t")
    check_request(
        schema, body, ProxySettings(tenants=(tenant,)), tenant, False, snapshot_for(None, None, inputs=inputs)
    )


def test_check_request_takes_what_the_model_takes_from_the_snapshot() -> None:
    body = {"messages": [{"role": "user", "content": [IMAGE]}]}
    with pytest.raises(FieldError):
        _check("chat", dict(body), TEXT_ONLY)
    _check("chat", dict(body), VISION)
    _check("chat", dict(body), None)


def test_json_schema_and_grammar_together_on_a_chat_route_are_the_clients_400() -> None:
    # The child's chat parser throws a runtime_error for it, which it answers 500.
    both = {"json_schema": {}, "grammar": 'root ::= "a"'}
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for schema, body in (
        ("chat", chat),
        ("responses", {"input": "x"}),
        ("messages", {**chat, "max_tokens": 1}),
    ):
        with pytest.raises(FieldError) as caught:
            _check(schema, {**body, **both}, None)
        assert caught.value.param == "grammar", schema
    _check("completion", {"prompt": "x", "json_schema": {}, "grammar": 'root ::= "a"'}, None)


async def test_an_unloaded_model_keeps_what_it_took_when_last_loaded() -> None:
    # The door checks a request to an on-demand model before loading it: from the last load's reading.
    import asyncio
    from types import SimpleNamespace
    from typing import cast

    from supervisor.daemon.model_hosts import ModelHost
    from tests.fakes.fake_upstream import snapshot_for

    live = snapshot_for("http://child", "s", inputs=TEXT_ONLY)
    sup = SimpleNamespace(
        observers=[],
        snapshot=lambda: live,
        machine=SimpleNamespace(generation=1),
        load_estimate_s=lambda: 1.0,
    )
    llama = SimpleNamespace(slots=1, ctx_per_slot=2048, embeddings=False, reranking=False)
    prepared = SimpleNamespace(
        spec=SimpleNamespace(alias="m", llama=llama), model=SimpleNamespace(shape=SimpleNamespace(n_vocab=10))
    )
    served = SimpleNamespace(name="m", on_demand=True, residency="on_demand")
    host = ModelHost(
        cast(Any, SimpleNamespace(served=served, prepared=prepared)),
        lambda n, p: cast(Any, sup),
        lambda h: None,
    )
    assert host.snapshot().inputs is None  # never loaded: unknown
    host.task = asyncio.get_running_loop().create_future()  # running
    assert host.snapshot().inputs == TEXT_ONLY
    host.task.cancel()
    unloaded = host.snapshot()
    assert unloaded.state == "UNLOADED" and unloaded.inputs == TEXT_ONLY
