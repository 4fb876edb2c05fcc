"""Client input never gets a 5xx (issue 54, item 4), end to end with the real daemon, child and demo model.

The demo model (SmolLM2 135M) is loaded without a projector (``/props`` ``modalities`` all false) and its
vocabulary has no fill-in-the-middle tokens (the pinned ``/infill`` answers 501 "prefix token is
missing"). What it takes is read from the child at load; so an image or audio part, on every dialect
that carries one, is a 400 naming the part, in the route's own error shape, and ``/infill`` a 404, where
the child answers 500 and 501. The child's pid never changes.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.integration.conftest import DaemonFactory, process_gone

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
IMAGE_URL = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
B64 = {"type": "base64", "media_type": "image/png", "data": PNG}

# (route, body, the part's path, the word in the refusal)
OPENAI_SHAPED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, IMAGE_URL]}],
        },
        "messages[0].content[1]",
        "image",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [AUDIO]}]},
        "messages[0].content[0]",
        "audio",
    ),
    (
        "/v1/responses",
        {
            "model": MODEL,
            "max_output_tokens": 2,
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}],
                }
            ],
        },
        "input[0].content[0]",
        "image",
    ),
    (
        "/completion",
        {"n_predict": 2, "prompt": {"prompt_string": "Describe <__media__>", "multimodal_data": [PNG]}},
        "prompt.multimodal_data",
        "multimodal",
    ),
    (
        "/v1/chat/completions/input_tokens",
        {"model": MODEL, "messages": [{"role": "user", "content": [IMAGE_URL]}]},
        "messages[0].content[0]",
        "image",
    ),
]


def test_media_parts_and_infill_are_refused_at_the_door_never_a_5xx(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    pid = d.child_pid
    assert pid is not None
    headers = {"Authorization": f"Bearer {d.inference_key}"}
    with httpx.Client(timeout=60.0, trust_env=False) as c:
        # Without the door's check the child answers each of these 500 ("image input is not supported").
        for route, body, path, word in OPENAI_SHAPED:
            r = c.post(d.base_url + route, json=body, headers=headers)
            where = f"{route}: {r.status_code} {r.text[:300]}"
            assert r.status_code == 400, where
            error = r.json()["error"]
            assert error["code"] == "invalid_field" and error["param"] == path, where
            assert f"takes no {word} input" in error["message"], where

        r = c.post(
            d.base_url + "/infill",
            json={"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 4},
            headers=headers,
        )
        assert r.status_code == 404, r.text
        assert "fill-in-the-middle" in r.json()["error"]["message"]

        # Anthropic's route, in Anthropic's shape: an image block, and one inside a tool result.
        anthropic_headers = {"x-api-key": d.inference_key, "anthropic-version": "2023-06-01"}
        for content, path in (
            (
                [{"type": "text", "text": "What is it?"}, {"type": "image", "source": B64}],
                "messages[0].content[1]",
            ),
            (
                [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": B64}]}],
                "messages[0].content[0].content[0]",
            ),
        ):
            body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
            r = c.post(d.base_url + "/v1/messages", json=body, headers=anthropic_headers)
            assert r.status_code == 400, r.text
            answer = r.json()
            assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
            assert path in answer["error"]["message"] and "takes no image input" in answer["error"]["message"]

        # Text still flows: the same routes with text only.
        r = c.post(
            d.base_url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            },
            headers=headers,
        )
        assert r.status_code == 200, r.text

    # The SDKs see a bad request naming the part.
    client = openai.OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": [IMAGE_URL]}],  # type: ignore[list-item]
        )
    assert "messages[0].content[0]" in str(caught.value)
    claude = anthropic.Anthropic(base_url=d.base_url, api_key=d.inference_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": B64}]}],  # type: ignore[list-item]
        )
    assert "takes no image input" in str(refused.value)
    assert not process_gone(pid) and d.child_pid == pid
