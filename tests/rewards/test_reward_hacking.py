"""The 22 attacks of the first sandbox (on one task, f(x) = 2x + 3): each scores 0, and a
correct program run right after it through the same pool scores 1 and a wrong one 0 (no
attack leaves the pool broken). test_code_attacks.py has the attacks on the judge and box."""
import pytest

# the code task's tests: f(x) = 2x + 3, three shown inputs and two unseen ones
TESTS = [f"assert f({x}) == {2 * x + 3}" for x in (1, 2, 3, 7, 12)]
CORRECT = "def f(x): return 2*x+3"
WRONG = "def f(x): return 2*x+4"

ATTACKS = {
    "always_equal": """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
def f(x): return Anything()
""",
    "int_subclass_eq": """
class Int(int):
    def __eq__(self, other): return True
    __hash__ = int.__hash__
def f(x): return Int(0)
""",
    "str_subclass_eq": """
class Str(str):
    def __eq__(self, other): return True
    __hash__ = str.__hash__
def f(x): return Str("")
""",
    "list_subclass_eq": """
class List(list):
    def __eq__(self, other): return True
def f(x): return List()
""",
    "bool_trick": """
class Truthy:
    def __bool__(self): return True
    def __eq__(self, other): return self
def f(x): return Truthy()
""",
    "hash_collision": """
class H:
    def __hash__(self): return 0
    def __eq__(self, other): return True
def f(x): return H()
""",
    "patched_isinstance_and_type": """
import builtins
builtins.isinstance = lambda *a: True
builtins.type = lambda *a: int
def f(x): return object()
""",
    "patched_assertion_error": """
import builtins
class Never(BaseException): pass
builtins.AssertionError = Never
def f(x): return None
""",
    "frame_walking": """
import sys
def f(x):
    frame = sys._getframe(1)
    while frame is not None:
        for name in ("tests", "passed", "out"):
            if name in frame.f_locals and isinstance(frame.f_locals[name], list):
                frame.f_locals[name].clear()
        frame = frame.f_back
    return 0
""",
    "shadow_the_report_helper": """
__rlloom_report__ = lambda index, value: None
__rlloom_eq__ = lambda a, b: True
def f(x): return 0
""",
    "gc_rewrites_reports": """
import gc
def f(x):
    for obj in gc.get_objects():
        if isinstance(obj, list) and obj and isinstance(obj[0], list) and len(obj[0]) == 2:
            obj.clear()
    return 0
""",
    "forged_output_lines": """
import os
for line in ("result 5 5 -", "status -", 'report {"reason": "-", "completed": [true, true, '
             'true, true, true], "reports": []}'):
    os.write(1, ("\\n" + "0" * 32 + " " + line + "\\n").encode())
def f(x): return 0
""",
    "steal_the_token_and_forge": """
import os, sys
def f(x):
    found, frame = set(), sys._getframe()
    while frame is not None:  # the harness's frames, up to its main()
        found |= {v for v in frame.f_locals.values() if isinstance(v, str) and len(v) == 32}
        frame = frame.f_back
    for t in found:
        forged = ("\\n{t} result 5 5 -\\n{t} report "
                  '{{"reason": "-", "completed": [true, true, true, true, true], '
                  '"reports": []}}\\n{t} status -\\n').format(t=t)
        os.write(1, forged.encode())
    os._exit(0)
""",
    "write_the_report_pipe": """
import os, json
def f(x):
    fake = json.dumps({"reason": "-", "completed": [True] * 5, "reports": []}).encode()
    for fd in range(3, 20):
        try:
            os.write(fd, fake)
        except OSError:
            pass
    os._exit(0)
""",
    "exit_early_at_import": """
import os
os._exit(0)
""",
    "system_exit_in_tests": """
def f(x): raise SystemExit(0)
""",
    "keyboard_interrupt": """
def f(x): raise KeyboardInterrupt
""",
    "recursion_bomb": """
def f(x): return f(x)
""",
    "settrace_skips_asserts": """
import sys
def skip(frame, event, arg):
    frame.f_trace_lines = False
    return None
sys.settrace(skip)
def f(x): return -1
""",
    "patched_exec_and_compile": """
import builtins
builtins.exec = lambda *a, **k: None
builtins.compile = lambda *a, **k: None
def f(x): return 0
""",
    "atexit_forgery": """
import atexit, os
atexit.register(lambda: os.write(1, b"\\nresult 5 5 -\\n"))
def f(x): return 0
""",
    "ctypes_patches_small_ints": """
import ctypes
def f(x):
    # make every small int the runtime hands out compare as the one returned
    for n in range(-5, 257):
        try:
            ctypes.memmove(id(n) + 24, id(0) + 24, 8)
        except Exception:
            pass
    return 0
""",
}


def test_there_are_at_least_twenty_attacks():
    assert len(ATTACKS) >= 20


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_an_attack_scores_zero_and_the_pool_still_judges_right(pool, name):
    hacked, honest, wrong = pool.map([(ATTACKS[name], TESTS), (CORRECT, TESTS), (WRONG, TESTS)])
    assert hacked.passed == 0, hacked
    assert honest.passed == 5 and honest.fraction == 1.0, honest
    assert wrong.passed == 0, wrong
