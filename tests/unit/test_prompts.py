"""Prompt sources and chat templating, with the bad inputs a user will hit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pipeline.data.chat import prompt_messages, tokenize_conversation
from pipeline.data.prompts import load_prompts, split_prompts
from pipeline.errors import PipelineError
from tests.conftest import go_offline, write_jsonl


def data_cfg(**overrides):
    values = dict(name="t", source="jsonl", path=None, split="train", messages_field="messages",
                  prompt_field="prompt", system_prompt=None, num_train=4, num_eval=2, shuffle_seed=0)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_humaneval_ships_offline():
    prompts = load_prompts(data_cfg(source="humaneval"))
    assert len(prompts) == 164
    assert prompts[0]["messages"][0]["role"] == "user" and len(prompts[0]["sample_id"]) == 16


def test_an_offline_source_reads_no_row_field_setting():
    """HumanEval's prompts are rows the source makes itself: data.messages_field / prompt_field (what a file's
    columns are called) change none of them, so the prompts key may leave them out (pipeline/paths.py)."""
    default = load_prompts(data_cfg(source="humaneval"))
    for fields in ({"prompt_field": "question"}, {"messages_field": "prompt"}, {"prompt_field": "messages"}):
        assert load_prompts(data_cfg(source="humaneval", **fields))[:] == default[:]


def test_jsonl_rows_become_deduplicated_conversations(prompts_jsonl):
    prompts = load_prompts(data_cfg(path=str(prompts_jsonl)))
    assert len(prompts) == 13  # 14 rows, one duplicate
    assert len(set(prompts["sample_id"])) == 13
    assert prompts[12]["messages"] == [{"role": "user", "content": "Say hello in French."}]


def test_no_training_conversation_asks_what_a_held_out_one_asks(tmp_path):
    """Two answers to one prompt are two conversations (both are trained on under generation.responses=keep): one
    landed in the held-out split and the other in training, and held-out tau measured a trained prompt."""
    rows = [{"messages": [{"role": "user", "content": f"q{i % 4}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(8)]
    prompts = load_prompts(data_cfg(path=str(write_jsonl(tmp_path / "p.jsonl", rows))))
    assert len(prompts) == 8  # the same user turns with another answer is another conversation
    train, held_out = split_prompts(prompts, data_cfg(num_train=4, num_eval=2))
    asked = {m["messages"][0]["content"] for m in held_out}
    assert len(train) == 4 and not asked & {m["messages"][0]["content"] for m in train}
    with pytest.raises(PipelineError, match=r"^data\.num_train: 5 but the source has only 4 conversations that ask "
                                            r"none of the 2 held-out prompts"):
        split_prompts(prompts, data_cfg(num_train=5, num_eval=2))


def test_parquet_source(tmp_path):
    import datasets

    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"prompt": f"q{i}"} for i in range(3)]).to_parquet(str(path))
    assert len(load_prompts(data_cfg(source="parquet", path=str(path)))) == 3


def test_a_parquet_prompt_column_of_nulls_is_named_and_the_file_is_read_without_a_progress_bar(tmp_path, capfd):
    import pyarrow
    import pyarrow.parquet

    path = tmp_path / "nulls.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"prompt": pyarrow.array([None, None], pyarrow.string())}), str(path))
    with pytest.raises(PipelineError, match=r"2 no 'messages', 'conversations', 'data' or 'prompt' field with a "
                                            r"value \(absent or null\)"):
        load_prompts(data_cfg(source="parquet", path=str(path)))
    assert "Generating train split" not in capfd.readouterr().err  # only the error line reaches the user


def test_split_is_disjoint_and_stable(prompts_jsonl):
    prompts = load_prompts(data_cfg(path=str(prompts_jsonl)))
    train, held_out = split_prompts(prompts, data_cfg())
    again, _ = split_prompts(prompts, data_cfg())
    assert not set(train["sample_id"]) & set(held_out["sample_id"])
    assert train["sample_id"] == again["sample_id"]


def test_missing_prompt_file_names_it(tmp_path):
    with pytest.raises(PipelineError, match=r"data\.path: prompt file .*nope\.jsonl' does not exist"):
        load_prompts(data_cfg(path=str(tmp_path / "nope.jsonl")))


@pytest.mark.parametrize("source", ["jsonl", "parquet"])
def test_a_folder_given_as_the_prompt_file_is_named_as_a_folder(source, tmp_path):
    folder = tmp_path / "prompts.jsonl"
    folder.mkdir()
    with pytest.raises(PipelineError, match=r"data\.path: prompt file .*prompts\.jsonl' is a folder, not a file"):
        load_prompts(data_cfg(source=source, path=str(folder)))
    with pytest.raises(PipelineError, match=r"data\.path: prompt file '/dev/null' is not a regular file"):
        load_prompts(data_cfg(source=source, path="/dev/null"))


def test_empty_dataset_is_a_clear_error(tmp_path):
    import datasets

    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_list([{"prompt": "x"}]).select([]).to_parquet(str(empty))
    with pytest.raises(PipelineError, match=r"data\.path: the prompt file .*empty\.parquet' is empty"):
        load_prompts(data_cfg(source="parquet", path=str(empty)))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(PipelineError, match="is empty"):
        load_prompts(data_cfg(path=str(blank)))


def test_unreadable_file_names_it(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(PipelineError, match=r"data\.path: line 1 of .*bad\.jsonl' is not JSON"):
        load_prompts(data_cfg(path=str(bad)))


def test_rows_without_usable_turns_are_skipped_and_all_bad_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": []}\n{"messages": [{"role": "assistant", "content": "hi"}]}\n')
    with pytest.raises(PipelineError, match="no usable conversation"):
        load_prompts(data_cfg(path=str(path)))


def test_too_few_prompts_for_the_split(prompts_jsonl):
    prompts = load_prompts(data_cfg(path=str(prompts_jsonl)))
    with pytest.raises(PipelineError, match="num_train"):
        split_prompts(prompts, data_cfg(num_train=100))


def test_loss_mask_covers_exactly_the_assistant_turns(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye"}]
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert len(ids) == len(mask)
    masked_text = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "Hello there" in masked_text and "Goodbye" in masked_text
    assert "Hi" not in masked_text and "Bye" not in masked_text.replace("Goodbye", "")
    assert prompt_messages(messages) == messages[:3]
    with pytest.raises(PipelineError, match="no assistant turn"):
        tokenize_conversation(tokenizer, messages[:1])


def test_sharegpt_and_ultrachat_rows_become_conversations(tmp_path):
    from tests.conftest import write_jsonl

    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye"}]},
        {"data": ["What is 2+2?", "4", "And 3+3?", "6"]},
    ])
    prompts = load_prompts(data_cfg(path=str(path)))
    assert [m["role"] for m in prompts[0]["messages"]] == ["system", "user", "assistant", "user"]
    assert prompts[0]["messages"][1]["content"] == "Hi"
    assert [m["role"] for m in prompts[1]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert prompts[1]["messages"][3]["content"] == "6"


def test_a_non_utf8_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(PipelineError, match=r"line 2 of .*bad\.jsonl' is not valid UTF-8"):
        load_prompts(data_cfg(path=str(path)))


@pytest.mark.parametrize("line, message", [
    (b'{"prompt": "\\ud800 lone"}', r"line 2 of .*odd\.jsonl' holds a lone UTF-16 surrogate escape \('\\ud800'\)"),
    (b'{"prompt": "n", "n": ' + b"1" * 5000 + b"}", r"line 2 of .*odd\.jsonl' is JSON Python cannot read"),
], ids=["lone surrogate", "integer past the digit limit"])
def test_a_json_line_python_reads_but_cannot_use_is_named(tmp_path, line, message):
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n' + line + b"\n")
    with pytest.raises(PipelineError, match=message):
        load_prompts(data_cfg(path=str(path)))


def test_a_byte_order_mark_before_the_first_line_is_read_past(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "first"}\n{"prompt": "second"}\n')
    assert [p["messages"][-1]["content"] for p in load_prompts(data_cfg(path=str(path), num_train=1, num_eval=1))
            ] == ["first", "second"]


def test_empty_conversations_are_skipped_and_reported(tmp_path, caplog):
    from tests.conftest import write_jsonl

    path = write_jsonl(tmp_path / "some_empty.jsonl", [
        {"messages": []}, {"messages": [{"role": "user", "content": "  "}]}, {"prompt": "real question"},
        {"prompt": "\u200b\u200b"}, {"prompt": "\ufeff\u200d \u2060\n"}, {"prompt": "\u200bvisible"}])
    prompts = load_prompts(data_cfg(path=str(path)))
    assert [p["messages"][-1]["content"] for p in prompts] == ["real question", "\u200bvisible"]
    assert "empty conversation" in caplog.text and "empty user turn" in caplog.text


def test_generation_prompt_mask_marks_earlier_answers(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
               {"role": "user", "content": "Bye"}]
    ids, mask = tokenize_conversation(tokenizer, history, add_generation_prompt=True)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]).startswith("Hello there")
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_text_parts_are_joined_and_tool_only_turns_are_left_out_and_counted(tmp_path, caplog):
    import logging

    from tests.conftest import write_jsonl

    path = write_jsonl(tmp_path / "openai.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Part one."}, "Part two."]}]},
        {"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": [{"type": "text", "text": "It is 18C."}]},
            {"role": "user", "content": "Thanks"}]},
    ])
    with caplog.at_level(logging.INFO, logger="pipeline.data.prompts"):
        prompts = load_prompts(data_cfg(path=str(path)))
    assert prompts[0]["messages"] == [{"role": "user", "content": "Part one.\nPart two."}]  # vLLM's joining
    assert prompts[1]["messages"] == [{"role": "user", "content": "Weather in Paris?"},
                                      {"role": "assistant", "content": "It is 18C."},
                                      {"role": "user", "content": "Thanks"}]
    assert "left out 1 turns: assistant turn with only tool calls" in caplog.text
    assert "left out 1 turns: tool result turn" in caplog.text


def test_a_row_holding_both_messages_and_a_prompt_says_which_was_read(tmp_path, caplog):
    """A file with both columns used `messages` and never said the prompt column went unread."""
    import logging

    from tests.conftest import write_jsonl

    path = write_jsonl(tmp_path / "both.jsonl", [
        {"messages": [{"role": "user", "content": "From messages."}], "prompt": "From prompt."},
        {"prompt": "Only a prompt."}])
    with caplog.at_level(logging.INFO, logger="pipeline.data.prompts"):
        prompts = load_prompts(data_cfg(path=str(path)))
    assert [m[0]["content"] for m in prompts["messages"]] == ["From messages.", "Only a prompt."]
    assert "left out 1 'prompt' fields of rows that hold 'messages' too (read instead)" in caplog.text


def test_an_empty_conversation_with_a_system_prompt_is_skipped_not_a_crash(tmp_path):
    from tests.conftest import write_jsonl

    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": []}, {"prompt": "real"}])
    prompts = load_prompts(data_cfg(path=str(path), system_prompt="Be brief."))
    assert len(prompts) == 1 and prompts[0]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_a_hub_dataset_that_cannot_load_is_one_line_naming_it(monkeypatch):
    """Offline (as here: hubs are unreachable) or a dataset id that does not exist: the field and the id, not the
    hub client's traceback."""
    go_offline(monkeypatch)
    with pytest.raises(PipelineError, match=r"data\.path: cannot load hub dataset 'no-such-org/no-such-set'") as error:
        load_prompts(OmegaConf.create(vars(data_cfg(source="hub", path="no-such-org/no-such-set", subset=None))))
    assert "\n" not in str(error.value)
