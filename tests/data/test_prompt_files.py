"""Prompt files as jsonl, parquet and `save_to_disk` directories: same rows, same problems, and
errors that name the row."""
import json
import re

import datasets
import pytest
from row_writer import FORMATS, write_rows

from rlloom.config_sections import DataSection
from rlloom.data.prompts import DataError, load_prompt_sets, read_prompt_file

ROWS = [
    {"prompt": "What is 2+2?", "answer": "4", "solution": "2+2=4", "source": "a"},
    {"prompt": "What is 3*3?", "answer": "9", "solution": "3*3=9", "source": "b"},
    {"prompt": "What is 10-7?", "answer": "3", "solution": "10-7=3", "source": "c"},
]
# How each format names the second row of a file written by write_rows.
SECOND_ROW = {"jsonl": "prompts.jsonl:2", "parquet": "prompts.parquet row 1",
              "saved": "prompts row 1"}


def _load_all(tmp_path, rows, task, columns=None):
    return {fmt: read_prompt_file(write_rows(tmp_path / fmt, fmt, rows), task, columns)
            for fmt in FORMATS}


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Point the Hugging Face datasets cache into tmp_path and check reading never fills it."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    yield
    assert not cache.exists()


def test_formats_load_identical_problems(tmp_path):
    loaded = _load_all(tmp_path, ROWS, "math")
    assert loaded["jsonl"] == loaded["parquet"] == loaded["saved"]
    assert [p.answer for p in loaded["jsonl"]] == ["4", "9", "3"]
    assert loaded["jsonl"][0].solution == "2+2=4"
    assert loaded["jsonl"][0].meta == {"source": "a"}


def test_countdown_rows_keep_their_types_in_every_format(tmp_path):
    rows = [{"prompt": "C:3,7=10?", "numbers": [3, 7], "target": 10}]
    loaded = _load_all(tmp_path, rows, "countdown")
    assert loaded["jsonl"] == loaded["parquet"] == loaded["saved"]
    assert loaded["parquet"][0].meta == {"numbers": [3, 7], "target": 10}


def test_code_rows_keep_tests_in_meta(tmp_path):
    tests = ["assert f(1) == 2", "assert f(2) == 3"]
    loaded = _load_all(tmp_path, [{"prompt": "F:f(1)=2?", "tests": tests}], "code")
    assert loaded["jsonl"] == loaded["parquet"] == loaded["saved"]
    [problem] = loaded["saved"]
    assert problem.answer == "" and problem.meta == {"tests": tests}


def test_code_rows_with_stdin_stdout_tests(tmp_path):
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]
    loaded = _load_all(tmp_path, [{"prompt": "Add two numbers.", "tests": tests}], "code")
    assert loaded["jsonl"] == loaded["parquet"] == loaded["saved"]
    assert loaded["saved"][0].meta == {"tests": tests}


@pytest.mark.parametrize("tests, message", [
    ([{"input": "1", "output": "2"}, "assert f(1) == 2"], "item 1 is 'assert f(1) == 2'"),
    ([{"input": "1"}], "item 0 is {'input': '1'}"),
    ([{"input": 1, "output": "2"}], "item 0 is {'input': 1, 'output': '2'}"),
])
def test_stdin_stdout_tests_must_all_be_input_output_strings(tmp_path, tests, message):
    path = write_rows(tmp_path, "jsonl", [{"prompt": "F", "tests": tests}])
    with pytest.raises(DataError, match=re.escape(f"prompts.jsonl:1: field 'tests' {message}")):
        read_prompt_file(path, "code")


def test_null_cells_read_as_absent_fields(tmp_path):
    # A table fills the field a jsonl row leaves out with null; both must give the same meta.
    rows = [{"prompt": "Q:1+1=", "answer": "2", "level": 1}, {"prompt": "Q:2+2=", "answer": "4"}]
    loaded = _load_all(tmp_path, rows, "arith")
    assert loaded["jsonl"] == loaded["parquet"] == loaded["saved"]
    assert loaded["parquet"][1].meta == {}


def test_column_mapping(tmp_path):
    rows = [{"question": r["prompt"], "gt": r["answer"], "solution": r["solution"],
             "source": r["source"]} for r in ROWS]
    loaded = _load_all(tmp_path, rows, "math", columns={"prompt": "question", "answer": "gt"})
    expected = read_prompt_file(write_rows(tmp_path / "plain", "jsonl", ROWS), "math")
    assert loaded["jsonl"] == loaded["parquet"] == loaded["saved"] == expected


def test_mapped_column_wins_over_a_column_with_the_field_name(tmp_path):
    rows = [{"prompt": "Q:1+1=", "answer": "wrong", "gt": "2"}]
    [problem] = read_prompt_file(write_rows(tmp_path, "jsonl", rows), "arith", {"answer": "gt"})
    assert problem.answer == "2" and problem.meta == {}


def test_load_prompt_sets_threads_columns(tmp_path):
    rows = [{"q": f"Q:{i}+0=", "a": str(i)} for i in range(10)]
    path = write_rows(tmp_path, "parquet", rows)
    data = DataSection(task="arith", difficulty=1, prompt_file=str(path), eval_fraction=0.2,
                       columns={"prompt": "q", "answer": "a"})
    sets = load_prompt_sets(data, 0)
    assert len(sets.train) == 8 and len(sets.eval) == 2
    assert {p.prompt for p in sets.train + sets.eval} == {r["q"] for r in rows}


# A table gives every row every column, so the bad second rows below are written with the
# first row holding all the columns they use; the bad row then has a null there, read as absent.
@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_mapped_column_names_row_and_columns(tmp_path, fmt):
    rows = [{"question": "Q:1+1=", "gt": "2", "truth": "2"}, {"question": "Q:2+2=", "truth": "4"}]
    path = write_rows(tmp_path, fmt, rows)
    with pytest.raises(DataError) as e:
        read_prompt_file(path, "arith", {"prompt": "question", "answer": "gt"})
    assert str(e.value).endswith(f"{SECOND_ROW[fmt]}: missing column 'gt' (mapped to field "
                                 "'answer'); the row has columns ['question', 'truth']")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad_row, message", [
    ({"prompt": "Q:2+2=", "level": 1},
     "missing field 'answer' required by task 'arith' (its verifier); the row has columns "
     "['prompt', 'level']; map a column with data.columns, or set data.task=none"),
    ({"prompt": "   ", "answer": "4", "level": 1}, "empty prompt"),
    ({"answer": "4", "level": 1},
     "missing field 'prompt' (or 'messages'); the row has columns ['answer', 'level']"),
])
def test_bad_rows_name_the_row(tmp_path, fmt, bad_row, message):
    path = write_rows(tmp_path, fmt, [{"prompt": "Q:1+1=", "answer": "2", "level": 1}, bad_row])
    with pytest.raises(DataError, match=re.escape(f"{SECOND_ROW[fmt]}: {message}")):
        read_prompt_file(path, "arith")


@pytest.mark.parametrize("fmt, where", [("jsonl", "prompts.jsonl:1"),
                                        ("parquet", "prompts.parquet row 0"),
                                        ("saved", "prompts row 0")])
def test_wrong_type_names_the_row(tmp_path, fmt, where):
    # A table column has one type, so a float answer column is wrong from its first row on.
    rows = [{"prompt": "Q:1+1=", "answer": 2.0}, {"prompt": "Q:2+2=", "answer": 4.0}]
    with pytest.raises(DataError, match=re.escape(
            f"{where}: field 'answer' has type float, task 'arith' needs")):
        read_prompt_file(write_rows(tmp_path, fmt, rows), "arith")


@pytest.mark.parametrize("fmt", FORMATS)
def test_code_row_with_a_non_string_test(tmp_path, fmt):
    rows = [{"prompt": "F:f(1)=2?", "tests": ["assert f(1) == 2"]},
            {"prompt": "F:f(1)=3?", "tests": ["assert f(1) == 3", None]}]
    with pytest.raises(DataError, match=re.escape(
            f"{SECOND_ROW[fmt]}: field 'tests' item 1 has type NoneType")):
        read_prompt_file(write_rows(tmp_path, fmt, rows), "code")


@pytest.mark.parametrize("tests, message", [
    ([], "field 'tests' is empty"),
    (["assert f(1) == 2", 3], "field 'tests' item 1 has type int"),
    (["  "], "field 'tests' item 0 is blank"),
    ("assert f(1) == 2", "field 'tests' has type str, task 'code' needs list"),
])
def test_code_tests_must_be_a_list_of_strings(tmp_path, tests, message):
    path = write_rows(tmp_path, "jsonl", [{"prompt": "F:f(1)=2?", "tests": tests}])
    with pytest.raises(DataError, match=re.escape(f"prompts.jsonl:1: {message}")):
        read_prompt_file(path, "code")


def test_dataset_dict_uses_the_train_split(tmp_path):
    path = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                          "test": datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(str(path))
    assert [p.prompt for p in read_prompt_file(path, "math")] == [r["prompt"] for r in ROWS[:2]]
    bad = [dict(ROWS[0]), {"prompt": "", "answer": "1"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(bad)}).save_to_disk(
        str(tmp_path / "bad"))
    with pytest.raises(DataError, match="bad/train row 1: empty prompt"):
        read_prompt_file(tmp_path / "bad", "math")


def test_dataset_dict_without_train_lists_its_splits(tmp_path):
    path = tmp_path / "splits"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS),
                          "validation": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(path))
    with pytest.raises(DataError, match=r"without a 'train' split; its splits are "
                                        r"\['test', 'validation'\]"):
        read_prompt_file(path, "math")


def test_unreadable_inputs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_prompt_file(tmp_path / "nope.parquet", "math")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        read_prompt_file(tmp_path / "plain_dir", "math")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="junk.parquet is not a readable parquet file"):
        read_prompt_file(tmp_path / "junk.parquet", "math")
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"prompt": [], "answer": []}).to_parquet(str(empty))
    with pytest.raises(DataError, match="has no rows"):
        read_prompt_file(empty, "math")


def test_trl_conversational_rows_ending_with_the_answer_give_it_as_the_solution(tmp_path):
    rows = tmp_path / "sft.jsonl"
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q:1+1="},
             {"role": "assistant", "content": "1+1=2.A:2"}]
    rows.write_text(json.dumps({"messages": turns, "answer": "2"}) + "\n"
                    + json.dumps({"messages": turns[:2], "answer": "2"}) + "\n")
    with_answer, prompt_only = read_prompt_file(rows, "arith")
    assert with_answer.prompt == turns[:2] and with_answer.solution == "1+1=2.A:2"
    assert prompt_only.prompt == turns[:2] and prompt_only.solution == ""
    # a prompt field (not TRL's messages) still may not end with an assistant turn
    rows.write_text(json.dumps({"prompt": turns, "answer": "2"}) + "\n")
    with pytest.raises(DataError, match="ends with a turn of role .assistant."):
        read_prompt_file(rows, "arith")
