"""Chat-format rows, as TRL and verl write them: a prompt is a string or a list of
{"role", "content"} turns; a preference response is a string or a list of assistant turns."""
from __future__ import annotations

from typing import Any

from rlloom.data.row_files import DataError

ROLES = ("system", "user", "assistant", "tool")

Messages = list[dict[str, str]]
Prompt = str | Messages


def check_turns(value: Any, where: str, field: str) -> Messages:
    """`value` as a list of chat turns, each a {"role", "content"} mapping with a known role
    and string content; errors name the row, the field and the turn."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of chat turns")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DataError(f"{where}: field {field!r} turn {i} must be a mapping with 'role' "
                            f"and 'content', got {str(turn)[:80]}")
        if turn["role"] not in ROLES:
            raise DataError(f"{where}: field {field!r} turn {i} has role {turn['role']!r}; "
                            f"roles are {', '.join(ROLES)}")
        if not isinstance(turn["content"], str):
            raise DataError(f"{where}: field {field!r} turn {i} content has type "
                            f"{type(turn['content']).__name__}, needs str")
        turns.append({"role": turn["role"], "content": turn["content"]})
    return turns


def read_prompt(value: Any, where: str, field: str = "prompt") -> Prompt:
    """A prompt field: a non-blank string, or chat turns ending with the turn the model answers
    (a user or tool turn)."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: empty {field}")
        return value
    if not isinstance(value, list):
        raise DataError(f"{where}: field {field!r} has type {type(value).__name__}; give a "
                        "string or a list of chat turns ({role, content})")
    turns = check_turns(value, where, field)
    if turns[-1]["role"] not in ("user", "tool"):
        raise DataError(f"{where}: field {field!r} ends with a turn of role "
                        f"{turns[-1]['role']!r}; a prompt ends with the user (or tool) turn the "
                        "model answers (TRL's `messages` rows may end with the assistant's "
                        "answer: it is then the row's solution)")
    return turns


def read_response(value: Any, where: str, field: str) -> str:
    """A preference response: a non-blank string, or one assistant turn (TRL's
    conversational chosen/rejected), whose content is the response."""
    if isinstance(value, list):
        turns = check_turns(value, where, field)
        if len(turns) != 1 or turns[0]["role"] != "assistant":
            raise DataError(f"{where}: field {field!r} must be one assistant turn, got roles "
                            f"{[t['role'] for t in turns]}")
        value = turns[0]["content"]
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {field!r} must be a non-empty string or one assistant "
                        "turn")
    return value


def with_system(prompt: Prompt, system: str | None) -> Prompt:
    """`prompt` opened by a system turn holding `system` (unless it has its own)."""
    if not system:
        return prompt
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if turns[0]["role"] == "system":
        return prompt
    return [{"role": "system", "content": system}, *turns]


def is_chat(prompt: Prompt) -> bool:
    return isinstance(prompt, list)
