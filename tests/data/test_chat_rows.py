"""Chat-format data as TRL and verl write it: prompts of role/content turns (`prompt` or
`messages`), a system prompt, a separate eval file, a per-row transform, and preference pairs
in every file format, plain or conversational."""
import re

import pytest
from row_writer import FORMATS, write_rows

from rlloom.config import ConfigError, load_config
from rlloom.config_sections import DataSection
from rlloom.data.preferences import PreferencePair, read_preference_file
from rlloom.data.prompts import DataError, load_prompt_sets, read_prompt_file
from rlloom.models.tokenizer import build_char_tokenizer
from rlloom.runtime.executor.launch import check_prompts
from rlloom.runtime.stages.batch import encode

TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q:1+1="}]
# A template the character tokenizer can spell: one line per turn, then the answer's cue.
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("field", ["prompt", "messages"])
def test_chat_turns_are_a_prompt_in_every_format(tmp_path, fmt, field):
    path = write_rows(tmp_path, fmt, [{field: TURNS, "answer": "2"}])
    [problem] = read_prompt_file(path, "arith")
    assert problem.prompt == TURNS and problem.answer == "2" and problem.meta == {}


@pytest.mark.parametrize("turns, message", [
    ([{"role": "robot", "content": "hi"}], "turn 0 has role 'robot'; roles are system, user, "
                                           "assistant, tool"),
    ([{"role": "user"}], "turn 0 must be a mapping with 'role' and 'content'"),
    ([{"role": "user", "content": 3}], "turn 0 content has type int, needs str"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
     "ends with a turn of role 'assistant'; a prompt ends with the user (or tool) turn the "
     "model answers"),
    ([], "must be a non-empty list of chat turns"),
])
def test_a_bad_chat_row_names_the_row_and_turn(tmp_path, turns, message):
    path = write_rows(tmp_path, "jsonl", [{"prompt": "Q:1+1=", "answer": "2"},
                                          {"prompt": turns, "answer": "2"}])
    with pytest.raises(DataError, match=re.escape(f"prompts.jsonl:2: field 'prompt' {message}")
                       if turns else re.escape(message)):
        read_prompt_file(path, "arith")


def test_system_prompt_opens_text_and_chat_prompts_without_one(tmp_path):
    path = write_rows(tmp_path, "jsonl", [{"prompt": "Q:1+1=", "answer": "2"},
                                          {"prompt": TURNS, "answer": "2"}])
    text, chat = read_prompt_file(path, "arith", system="Think.")
    assert text.prompt == [{"role": "system", "content": "Think."},
                           {"role": "user", "content": "Q:1+1="}]
    assert chat.prompt == TURNS  # its own system turn stays


def test_eval_file_and_transform(tmp_path):
    (tmp_path / "fix.py").write_text(
        "def fix(row):\n    return {'prompt': row['q'], 'answer': str(row['a'])}\n")
    train = write_rows(tmp_path / "t", "jsonl", [{"q": f"Q:{i}+0=", "a": i} for i in range(6)])
    held = write_rows(tmp_path / "e", "parquet", [{"q": "Q:9+0=", "a": 9}])
    data = DataSection(task="arith", prompt_file=str(train), eval_file=str(held),
                       transform=f"{tmp_path / 'fix.py'}:fix")
    sets = load_prompt_sets(data, seed=0)
    assert len(sets.train) == 6  # the whole prompt file trains: the eval file holds out
    assert [(p.prompt, p.answer) for p in sets.eval] == [("Q:9+0=", "9")]
    built_in = load_prompt_sets(DataSection(eval_file=str(held),
                                            transform=data.transform), seed=0)
    assert len(built_in.train) == 20000 and len(built_in.eval) == 1


def test_a_failing_transform_names_the_row_and_function(tmp_path):
    (tmp_path / "fix.py").write_text("def fix(row):\n    return row['missing']\n"
                                     "def lst(row):\n    return [row]\n")
    path = write_rows(tmp_path, "jsonl", [{"prompt": "Q:1+1=", "answer": "2"}])
    with pytest.raises(DataError, match=r"prompts.jsonl:1: data transform 'fix' raised "
                                        r"KeyError: 'missing'"):
        read_prompt_file(path, "arith", transform=f"{tmp_path / 'fix.py'}:fix")
    with pytest.raises(DataError, match="'lst' returned list; it must return the row as a dict"):
        read_prompt_file(path, "arith", transform=f"{tmp_path / 'fix.py'}:lst")
    with pytest.raises(ConfigError, match="data.transform .*has no function 'nope'"):
        load_config(None, [f"data.transform={tmp_path / 'fix.py'}:nope"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_preference_pairs_plain_and_conversational_in_every_format(tmp_path, fmt):
    plain = [{"prompt": "Q:1+1=", "chosen": "2", "rejected": "3"}]
    chat = [{"prompt": [{"role": "user", "content": "Q:2+2="}],
             "chosen": [{"role": "assistant", "content": "4"}],
             "rejected": [{"role": "assistant", "content": "5"}]}]
    # a table holds one type per column, so each form has its own file
    pairs = [pair for rows, name in ((plain, "plain"), (chat, "chat")) for pair in
             read_preference_file(write_rows(tmp_path, fmt, rows, name), system="Be brief.")]
    system = {"role": "system", "content": "Be brief."}
    assert pairs == [
        PreferencePair([system, {"role": "user", "content": "Q:1+1="}], "2", "3"),
        PreferencePair([system, {"role": "user", "content": "Q:2+2="}], "4", "5")]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "Q", "chosen": "2"}, "missing fields ['rejected']"),
    ({"prompt": "Q", "chosen": [{"role": "user", "content": "2"}], "rejected": "3"},
     "field 'chosen' must be one assistant turn, got roles ['user']"),
    ({"prompt": "Q", "chosen": "2", "rejected": " "}, "field 'rejected' must be a non-empty"),
])
def test_bad_preference_rows_name_the_row(tmp_path, row, message):
    path = write_rows(tmp_path, "jsonl", [row], "pairs")
    with pytest.raises(DataError, match=re.escape(f"pairs.jsonl:1: {message}")):
        read_preference_file(path)


def test_a_preference_parquet_file_is_read_not_decoded_as_text(tmp_path):
    path = write_rows(tmp_path, "parquet", [{"prompt": "Q", "chosen": "2", "rejected": "3"}],
                      "pairs")
    assert read_preference_file(path) == [PreferencePair("Q", "2", "3")]


def test_chat_prompts_render_through_the_template():
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    assert tok.decode(encode(tok, [TURNS])[0]) == "s:Be brief.|u:Q:1+1=|a:"
    assert tok.decode(encode(tok, ["Q:1+1="])[0]) == "u:Q:1+1=|a:"


def test_chat_prompts_without_a_template_are_refused_before_the_run(tmp_path):
    path = write_rows(tmp_path, "jsonl", [{"prompt": TURNS, "answer": "2"}] * 2)
    cfg = load_config(None, [f"data.prompt_file={path}"])
    with pytest.raises(DataError, match=r"prompts.jsonl:\d has a prompt of chat turns, but the "
                                        r"tokenizer has no chat template \(data.chat_template="
                                        r"auto\); set data.chat_template to a jinja"):
        check_prompts(cfg, build_char_tokenizer())
    cfg = load_config(None, ["data.system_prompt=Think."])
    with pytest.raises(DataError, match="data.system_prompt makes every prompt chat turns"):
        check_prompts(cfg, build_char_tokenizer())


def test_the_length_limit_counts_the_template(tmp_path):
    path = write_rows(tmp_path, "jsonl", [{"prompt": "Q:1+1=", "answer": "2"}] * 2)
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    # "u:Q:1+1=|a:" is 11 characters (plus BOS if the tokenizer adds one): 6 of them prompt
    n = len(encode(tok, ["Q:1+1="])[0])
    check_prompts(load_config(None, [f"data.prompt_file={path}",
                                            f"data.max_prompt_tokens={n}"]), tok)
    with pytest.raises(DataError, match=f"prompt has {n} tokens \\(chat template included\\)"):
        check_prompts(load_config(None, [f"data.prompt_file={path}",
                                                f"data.max_prompt_tokens={n - 1}"]), tok)
