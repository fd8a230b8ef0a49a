"""Multi-turn rollouts with tools: what each turn and tool call adds to the response, which
tokens are masked out of training, why a conversation ends, and the failures a model (or a
tool) may cause, each given back as an error turn instead of crashing the run."""
import time

import pytest
import torch

from rlloom.models.tokenizer import build_char_tokenizer
from rlloom.rollout.generate import Rollout, right_pad
from rlloom.rollout.multi_turn import Dialogue, Tools
from rlloom.rollout.tools import PythonTool, ToolRunner, calculator, parse_call

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def _ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def _scripted(turns):
    """A generate function that answers conversation i's j-th turn with turns[i][j] (EOS
    written as "$"), each token at log-prob -0.5; it finds i from the prompt's first token."""
    def generate(prompts, room):
        out = []
        for p in prompts:
            i = p[0] - _ids("0")[0]
            j = sum(1 for t in range(len(p)) if TOK.decode(p[:t + 1]).endswith("</result>"))
            text = turns[i][j]
            ids = [EOS if c == "$" else _ids(c)[0] for c in text][:room]
            out.append(ids)
        ids, mask = right_pad(out, 0)
        done = torch.tensor([t[-1] in (EOS, _ids(">")[0]) for t in out])
        return Rollout(ids, torch.ones_like(ids), ids, mask, torch.full(ids.shape, -0.5) * mask,
                       done, None)
    return generate


def _slow(args):
    time.sleep(5)
    return "never"


def _huge(args):
    return "x" * 1_000_000


def _boom(args):
    raise RuntimeError("disk on fire")


def _converse(turns, max_new=120, max_turns=3, fmt="tag"):
    """The rollout and the conversations' stats of `Dialogue.converse` over scripted turns."""
    runner = ToolRunner({"calculator": calculator, "slow": _slow, "huge": _huge,
                         "boom": _boom}, timeout_s=0.3, max_chars=20)
    prompts = [_ids(f"{i}Q") for i in range(len(turns))]
    dialogue = Dialogue(Tools(runner, max_turns, fmt), len(prompts), max_new, TOK.decode, _ids)
    return dialogue.converse(_scripted(turns), prompts, pad_id=0), dialogue


def _text(r, i=0):
    return TOK.decode(r.response_ids[i][r.response_mask[i].bool()], skip_special_tokens=True)


def test_a_tool_result_is_inserted_and_masked_out_of_training():
    r, d = _converse([["<call calculator>347*58</call>", "A:20126$"]])
    [c] = d.convs
    assert _text(r) == "<call calculator>347*58</call><result>20126</result>A:20126"
    inserted = TOK.decode(r.response_ids[0][r.injected[0].bool()])
    assert inserted == "<result>20126</result>"
    # sampled tokens keep their log-probs; inserted ones are not actions
    assert torch.equal(r.action_mask[0].bool(), r.injected[0] == 0)
    assert (r.logprobs[0][r.injected[0].bool()] == 0).all()
    assert (r.logprobs[0][r.action_mask[0].bool()] == -0.5).all()
    assert (c.end, c.finished, c.turns, c.calls, c.errors) == ("answer", True, 2, 1, 0)


@pytest.mark.parametrize("call, result", [
    ("<call nope>1</call>", "<result>error: unknown tool 'nope'; tools are calculator, slow, "
                            "huge, boom</result>"),
    ("<call calculator>1+</call>", "<result>error: ValueError: "),
    ("<call>1+1</call>", "<result>error: malformed tool call: write <call NAME>ARGS</call>"
                         "</result>"),
    ("<call slow>x</call>", "<result>error: tool 'slow' took longer than 0.3 s</result>"),
    ("<call boom>x</call>", "<result>error: RuntimeError:...[13 more characters]</result>"),
    ("<call huge>x</call>", "<result>xxxxxxxxxxxxxxxxxxxx...[999980 more characters]</result>"),
])
def test_a_failing_call_is_an_error_turn_and_the_model_goes_on(call, result):
    start = time.perf_counter()
    r, d = _converse([[call, "A:2$"]], max_new=200)
    [c] = d.convs
    text = _text(r)
    assert text.startswith(call + result)
    assert text.endswith("A:2") and c.end == "answer"
    assert c.errors == (0 if "huge" in call else 1)
    assert time.perf_counter() - start < 2  # the hung tool was abandoned at its timeout


def test_json_calls_and_why_conversations_end():
    assert parse_call('<call>{"name": "calculator", "arguments": "2*3"}</call>', "json").args \
        == "2*3"
    r, d = _converse([
        ["<call calculator>1+1</call>"] * 3,
        ["A:" + "1" * 200],                 # no EOS within the budget
        ["<call calculator>9*9</call>", "A:81$"],
    ], max_new=150, max_turns=3)
    assert [c.end for c in d.convs] == ["max_turns", "length", "answer"]
    assert r.finished.tolist() == [False, False, True]
    assert d.stats()[:, :3].tolist() == [[3, 2, 0], [1, 0, 0], [2, 1, 0]]
    # a result that would fill the budget ends the conversation instead
    r, d = _converse([["<call huge>x</call>", "A:1$"]], max_new=40)
    assert d.convs[0].end == "context" and d.convs[0].calls == 1 and not r.injected.any()


def test_user_tools_load_from_a_file_and_bad_settings_are_refused(tmp_path, monkeypatch):
    from rlloom.config import ConfigError, load_config

    (tmp_path / "my_tools.py").write_text(
        "async def lookup(args):\n    return args.upper()\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["rollout.tools=[calculator, my_tools.py:lookup]",
                             "rollout.max_turns=2"])
    tools = Tools.of(cfg.rollout)
    [result] = tools.runner.run([parse_call("<call lookup>abc</call>", "tag")])
    assert (result.text, result.error) == ("ABC", False)  # an async tool, awaited
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        load_config(None, ["rollout.tools=[my_tools.py:nope]", "rollout.max_turns=2"])
    with pytest.raises(ConfigError, match="set rollout.tools .* with rollout.max_turns > 1"):
        load_config(None, ["rollout.max_turns=3"])
    with pytest.raises(ConfigError, match="multi-turn rollouts .* finish in their step"):
        load_config(None, ["rollout.tools=[calculator]", "rollout.max_turns=2",
                           "rollout.partial_tokens=8"])


def test_python_tool_prints_what_the_program_prints_in_the_sandbox():
    tool = PythonTool()
    assert tool("import os\nprint(6 * 7, os.path.exists('/etc'))") == "42 False"
    with pytest.raises(RuntimeError, match="exit code 1; ZeroDivisionError"):
        tool("print(1 / 0)")
