"""``tests.helpers.llama_schema``: what the fuzz and the schema tests read out of server-schema.cpp."""

from __future__ import annotations

import pytest

from tests.helpers.llama_schema import SchemaField, parse_server_schema

SOURCE = r"""
std::vector<std::unique_ptr<field>> make_llama_cmpl_schema(
        const common_params & params_base, task_params & params) {
    add((new field_bool("stream", params.stream))
        ->set_desc("Stream tokens, see https://example.org/a//b"));

    add((new field_nested("stream_options"))
        ->add_subfield((new field_bool("include_usage", params.include_usage))
            ->set_desc("usage"))
        ->set_desc("Additional options"));

    add((new field_num("n_predict", params.n_predict))
        ->set_hard_limits(-1, INT32_MAX)
        ->add_alias("max_completion_tokens")
        ->add_alias("max_tokens"));

    // add((new field_num("t_max_prompt_ms", params.t_max_prompt_ms))

    add((new field_num("n_cmpl", params.n_cmpl))
        ->add_alias("n") // alias "n" as fallback (OpenAI completions API)
        ->set_desc("completions"));
#if 0
    add((new field_num("speculative.n_max", params.speculative.draft.n_max)));
#endif
    add((new field_json("grammar_triggers"))
        ->set_handler([&](field_eval_context & ctx, const json & data) {}));
    return fields;
}

task_params eval_llama_cmpl_schema(const llama_vocab * vocab) {
    field_num("not_a_field", x);
}
"""


def test_fields_aliases_and_subfields_are_read_and_disabled_code_is_not() -> None:
    assert parse_server_schema(SOURCE) == [
        SchemaField("bool", ("stream",)),
        SchemaField("nested", ("stream_options",)),
        SchemaField("bool", ("include_usage",), "stream_options"),
        SchemaField("num", ("n_predict", "max_completion_tokens", "max_tokens")),
        SchemaField("num", ("n_cmpl", "n")),
        SchemaField("json", ("grammar_triggers",)),
    ]


def test_a_subfield_is_addressed_under_its_parent() -> None:
    (_, _, usage, *_) = parse_server_schema(SOURCE)
    assert usage.paths() == ("stream_options.include_usage",)


def test_a_source_without_the_schema_function_is_an_error_not_an_empty_list() -> None:
    with pytest.raises(ValueError, match="make_llama_cmpl_schema"):
        parse_server_schema("int main() { return 0; }")
