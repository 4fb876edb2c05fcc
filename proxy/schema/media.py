"""Media parts and fill-in-the-middle, checked against what the loaded model takes (``ModelInputs``, read
from the child at load).

The pinned child answers an image or audio part sent to a model without a projector with a 500 ("image
input is not supported", ``server-common.cpp`` ``oaicompat_content_load_media``; "Multimodal data
provided, but model does not support multimodal requests" for a prompt's ``multimodal_data``), and
``/infill`` on a model whose vocabulary lacks the FIM tokens with a 501. Both are the client's input, not
a server fault: the door refuses them first, a 400 naming the part, a 404 for ``/infill`` (as the
embeddings routes on a model started without them).

Where each dialect carries media, as the child converts it (``server-chat.cpp``):
- chat: ``messages[].content[]`` parts ``image_url`` (vision), ``input_audio`` (audio), ``input_video`` and
  ``video_url`` (video);
- Anthropic Messages: ``image`` blocks, in a message's content and in a ``tool_result``'s (documents are
  dropped by the child, not refused);
- Responses: ``input_image`` in a message item's ``content`` and a ``function_call_output``'s ``output``;
- the native and OpenAI completions, infill and embeddings: a prompt object's ``multimodal_data``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from proxy.errors import NotFound
from proxy.schema.values import FieldError
from proxy.source import ModelInputs

# Part type -> the modality it needs.
_CHAT_PARTS = {"image_url": "vision", "input_audio": "audio", "input_video": "video", "video_url": "video"}
_WORDS = {"vision": "image", "audio": "audio", "video": "video", "multimodal": "multimodal"}
# Which schemas carry their media where.
_CHAT = ("chat",)
_ANTHROPIC = ("messages", "count_tokens")
_RESPONSES = ("responses",)
_PROMPTS = {
    "completion": ("prompt",),
    "completions": ("prompt",),
    "infill": ("prompt",),
    "embeddings": ("input", "content"),
}


def _parts(items: Any, path: str) -> Iterator[tuple[Any, str]]:
    if isinstance(items, list):
        for i, part in enumerate(items):
            if isinstance(part, dict):
                yield part, f"{path}[{i}]"


def media_parts(schema: str, payload: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(path, modality) of every media part of a body of ``schema``."""
    if schema in _CHAT:
        for message, where in _parts(payload.get("messages"), "messages"):
            for part, at in _parts(message.get("content"), f"{where}.content"):
                need = _CHAT_PARTS.get(str(part.get("type")))
                if need is not None:
                    yield at, need
    elif schema in _ANTHROPIC:
        for message, where in _parts(payload.get("messages"), "messages"):
            for block, at in _parts(message.get("content"), f"{where}.content"):
                if block.get("type") == "image":
                    yield at, "vision"
                elif block.get("type") == "tool_result":
                    for inner, deep in _parts(block.get("content"), f"{at}.content"):
                        if inner.get("type") == "image":
                            yield deep, "vision"
    elif schema in _RESPONSES:
        for item, where in _parts(payload.get("input"), "input"):
            for key in ("content", "output"):
                for part, at in _parts(item.get(key), f"{where}.{key}"):
                    if part.get("type") == "input_image":
                        yield at, "vision"
    for name in _PROMPTS.get(schema, ()):
        prompt = payload.get(name)
        if isinstance(prompt, dict) and "multimodal_data" in prompt:
            yield f"{name}.multimodal_data", "multimodal"
        for element, at in _parts(prompt, name):
            if "multimodal_data" in element:
                yield f"{at}.multimodal_data", "multimodal"


def check_inputs(schema: str, payload: dict[str, Any], inputs: ModelInputs | None, model: str) -> None:
    """Refuse what the model cannot take; nothing when what it takes is unknown (``inputs`` None)."""
    if inputs is None:
        return
    if schema == "infill" and not inputs.fim:
        raise NotFound(
            f"/infill is not available for the model '{model}': its vocabulary has no fill-in-the-middle"
            " tokens"
        )
    for path, need in media_parts(schema, payload):
        takes = inputs.multimodal if need == "multimodal" else getattr(inputs, need)
        if not takes:
            word = _WORDS[need]
            raise FieldError(
                path, f"is {word} input; the model '{model}' takes no {word} input (no projector is loaded)"
            )
