"""``llama.chat_template`` with the real llama-server and the real demo models, through the proxy.

Gemma 3's demo GGUF carries no chat template; without one llama-server falls back to ChatML, which Gemma
does not know, and answered ``Hello<|im_end|>\\n<|im_start|>user\\n...``. That model gets the built-in
``gemma`` format, whose turn markers are special tokens of its own vocabulary: they are never printed as
text, and ``<end_of_turn>`` ends the answer when the model emits it. The default demo model (SmolLM2
Instruct) brings its own template in its GGUF, and ends its answer by itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from tests.integration.conftest import DaemonFactory

pytestmark = pytest.mark.integration

TEMPLATE_TOKENS = ("<|im_end|>", "<|im_start|>", "<start_of_turn>", "<end_of_turn>")


def template_debris(text: str) -> list[str]:
    return [token for token in TEMPLATE_TOKENS if token in text]


def test_the_default_demo_model_answers_hello_and_stops_by_itself(daemon_factory: DaemonFactory) -> None:
    """The README's and the start banner's request: "Hello", max_tokens 64, temperature 0 (the same answer
    every time) ends with finish_reason stop, without template debris."""
    d = daemon_factory({})
    client = OpenAI(base_url=f"{d.base_url}/v1", api_key=d.inference_key, max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=64,
        temperature=0,
        messages=[{"role": "user", "content": "Hello"}],
    )
    content = reply.choices[0].message.content or ""
    assert reply.choices[0].finish_reason == "stop", content
    assert reply.usage is not None and 0 < reply.usage.completion_tokens < 64
    assert content.strip() and template_debris(content) == [], content


def test_the_gemma_demo_model_answers_without_template_tokens(
    daemon_factory: DaemonFactory, gemma_model: Path
) -> None:
    from supervisor.artifacts.demo_model import GEMMA

    # The Gemma demo model named by path and sha256, as an operator would: its template by its digest.
    model = {"path": str(gemma_model), "sha256": GEMMA.sha256, "alias": "gemma-3-270m"}
    d = daemon_factory({"llama": {"model": model}})
    client = OpenAI(base_url=f"{d.base_url}/v1", api_key=d.inference_key, max_retries=0)
    for prompt in ("Hello", "What is the capital of France?", "Write one sentence about the sea."):
        reply = client.chat.completions.create(
            model="gemma-3-270m", max_tokens=64, messages=[{"role": "user", "content": prompt}]
        )
        content = reply.choices[0].message.content or ""
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        assert template_debris(content) == [], content
    # Streamed: the same, chunk by chunk.
    stream = client.chat.completions.create(
        model="gemma-3-270m", max_tokens=64, stream=True, messages=[{"role": "user", "content": "Hello"}]
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert template_debris(text) == [], text


def test_a_template_file_reaches_the_child(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """A Jinja file that puts 40 words before every message: the prompt's token count shows it was
    used (the demo's own format makes about 10 tokens of "Hello")."""
    template = tmp_path / "padded.jinja"
    template.write_text(
        "{% for m in messages %}" + "word " * 40 + "{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}Answer:{% endif %}"
    )
    d = daemon_factory({"llama": {"chat_template": str(template)}})
    client = OpenAI(base_url=f"{d.base_url}/v1", api_key=d.inference_key, max_retries=0)
    usage = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=1, messages=[{"role": "user", "content": "Hello"}]
    ).usage
    assert usage is not None
    assert usage.prompt_tokens > 40, usage
