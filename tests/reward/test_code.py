import re
import tempfile
import time

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.reward.code import extract_code, fenced_blocks, run_tests
from areal_hpc.reward.sandbox import Sandbox

SANDBOX_OK, SANDBOX_WHY = Sandbox.available()
needs_sandbox = pytest.mark.skipif(not SANDBOX_OK, reason=f"no code sandbox here: {SANDBOX_WHY}")

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7", "output": "12"}]


@needs_sandbox
def test_correct_program_passes():
    assert run_tests(ADD, TESTS) == {"passed": [True, True], "errors": [None, None],
                                     "reward": 1.0, "error": None}


@needs_sandbox
def test_program_in_a_fenced_block_of_a_completion():
    completion = f"Read two numbers.\n```python\n{ADD}```\nThat is all."
    assert run_tests(completion, TESTS)["reward"] == 1.0


@needs_sandbox
def test_wrong_output_fails_only_where_wrong():
    code = "a, b = map(int, input().split())\nprint(3)\n"
    assert run_tests(code, TESTS) == {"passed": [True, False], "errors": [None, "wrong answer"],
                                      "reward": 0.0, "error": None}


@needs_sandbox
def test_trailing_whitespace_per_line_and_trailing_blank_lines_do_not_count():
    code = "print('1 2   ')\nprint('3\\t')\nprint()\nprint()\n"
    assert run_tests(code, [{"input": "", "output": "1 2\n3"}])["reward"] == 1.0
    # Leading whitespace and inner blank lines do.
    assert run_tests(code, [{"input": "", "output": " 1 2\n3"}])["reward"] == 0.0
    assert run_tests(code, [{"input": "", "output": "1 2\n\n3"}])["reward"] == 0.0


@needs_sandbox
def test_infinite_loop_fails_within_the_timeout():
    start = time.monotonic()
    result = run_tests("while True:\n    pass\n", TESTS[:1], timeout_s=0.5)
    assert time.monotonic() - start < 3.0
    # A timeout is an error (the test could not be judged), not only a failed test.
    assert result == {"passed": [False], "errors": ["timeout after 0.5 s"], "reward": 0.0,
                      "error": "test 0: timeout after 0.5 s"}


@needs_sandbox
def test_memory_bomb_fails_with_memory_error():
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n"
    result = run_tests(code, TESTS[:1], timeout_s=30.0, memory_mb=256)   # the bound: a guard only
    assert result == {"passed": [False], "errors": ["MemoryError"], "reward": 0.0, "error": None}


@needs_sandbox
def test_exception_gives_its_last_traceback_line():
    result = run_tests("print(1 // 0)", TESTS[:1])
    assert result == {"passed": [False],
                      "errors": ["ZeroDivisionError: integer division or modulo by zero"],
                      "reward": 0.0, "error": None}


@needs_sandbox
def test_syntax_error():
    result = run_tests("def f(:\n    pass\n", TESTS[:1])
    assert result == {"passed": [False], "errors": ["SyntaxError: invalid syntax"],
                      "reward": 0.0, "error": None}


@needs_sandbox
def test_nonzero_exit_without_stderr_fails():
    result = run_tests("import sys\nprint(3)\nsys.exit(2)\n", TESTS[:1])
    assert result == {"passed": [False], "errors": ["exit code 2"], "reward": 0.0, "error": None}


@needs_sandbox
def test_endless_output_is_cut_by_the_file_size_limit():
    result = run_tests("while True:\n    print('x' * 100000)\n", TESTS[:1], timeout_s=10.0)
    assert result == {"passed": [False], "errors": ["OSError: [Errno 27] File too large"],
                      "reward": 0.0, "error": None}


@needs_sandbox
def test_stop_on_first_failure_skips_the_rest():
    tests = [TESTS[1], TESTS[0], TESTS[1]]  # the program prints 3: wrong, right, wrong
    result = run_tests("input()\nprint(3)", tests, stop_on_first_failure=True)
    assert result == {"passed": [False, False, False],
                      "errors": ["wrong answer", "skipped", "skipped"], "reward": 0.0, "error": None}


@needs_sandbox
def test_runs_isolated_in_a_scratch_directory_with_a_minimal_environment():
    probe = ("import os, sys\n"
             "print(os.getcwd())\n"
             "print(sorted(os.environ))\n"
             "print(sys.flags.isolated)\n")
    expected = "/tmp\n['LANG', 'PATH']\n1\n"
    assert run_tests(probe, [{"input": "", "output": expected}])["reward"] == 1.0


def test_unsafe_no_sandbox_runs_without_isolation():
    probe = ("import os\n"
             "print(os.path.basename(os.getcwd())[:11])\n"
             "print(sorted(os.environ))\n")
    expected = "areal_code_\n['LANG', 'PATH']\n"
    assert run_tests(probe, [{"input": "", "output": expected}],
                     unsafe_no_sandbox=True) == {"passed": [True], "errors": [None],
                                                 "reward": 1.0, "error": None}
    result = run_tests("while True:\n    pass\n", TESTS[:1], timeout_s=0.5,
                       unsafe_no_sandbox=True)
    assert result["error"] == "test 0: timeout after 0.5 s"


@needs_sandbox
def test_scratch_directory_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    probe = "open('out.txt', 'w').write('x' * 1000)\nprint('ok')"
    assert run_tests(probe, [{"input": "", "output": "ok"}])["reward"] == 1.0
    assert list(tmp_path.iterdir()) == []


@needs_sandbox
def test_children_left_by_the_program_are_killed():
    # The program starts a sleeping child and exits; the child is killed with its group.
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(p.pid)\n")
    before = {p.pid for p in psutil.process_iter()}
    result = run_tests(code, [{"input": "", "output": "?"}])
    assert result["errors"] == ["wrong answer"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        sleepers = [p for p in psutil.process_iter(["cmdline", "status"])
                    if p.pid not in before and p.info["status"] != psutil.STATUS_ZOMBIE
                    and "time.sleep(60)" in " ".join(p.info["cmdline"] or [])]
        if not sleepers:
            break
        time.sleep(0.05)
    assert sleepers == []


def test_malformed_inputs_never_raise():
    assert run_tests(None, TESTS[:1]) == {
        "passed": [False], "errors": ["code must be a string, got NoneType"], "reward": 0.0,
        "error": "test 0: code must be a string, got NoneType"}
    malformed = run_tests(ADD, [{"input": 1, "output": "3"}])
    assert malformed["errors"] == ["malformed test: expected {'input': str, 'output': str}"]
    assert malformed["error"] == "test 0: malformed test: expected {'input': str, 'output': str}"
    assert run_tests(ADD, None) == {"passed": [], "errors": [], "reward": 0.0, "error": None}
    assert run_tests(ADD, []) == {"passed": [], "errors": [], "reward": 0.0, "error": None}  # no tests: no reward


@pytest.mark.parametrize("completion, code", [
    ("print(1)", "print(1)"),                                          # bare source
    ("Text\n```python\nprint(1)\n```\nmore", "print(1)\n"),
    ("```python\nprint(1)\n```\n```python\nprint(2)\n```", "print(2)\n"),   # the last block
    ("```py\nprint(1)\n```", "print(1)\n"),
    ("```Python3\nprint(1)\n```", "print(1)\n"),
    ("```\nprint(1)\n```", "print(1)\n"),                              # untagged block
    ("```python\nprint(1)\n```\n```\n3\n```", "print(1)\n"),           # tagged beats untagged
    ("```text\n3\n```", "```text\n3\n```"),                            # no code block: all text
    ("```python\nprint(1)\n```\n```python\nprint(2)", "print(1)\n"),   # unclosed: not a block
])
def test_extract_code(completion, code):
    assert extract_code(completion) == code


_FENCE_REGEX = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["```", "`", "python", "py", " ", "\n", "x", "-"]), max_size=30))
def test_fenced_blocks_in_one_pass_equal_the_regex(parts):
    """The fence scanner against the regular expression it replaced (which backtracked over the
    rest of the text at every unclosed fence: quadratic)."""
    text = "".join(parts)
    assert fenced_blocks(text) == [(m.group(1), m.group(2)) for m in _FENCE_REGEX.finditer(text)]


def test_unclosed_fences_of_a_looping_completion():
    assert extract_code("```python\nprint(1)\n```\n" + "``` " * 20000) == "print(1)\n"


def test_output_is_compared_as_bytes_under_a_size_cap():
    from areal_hpc.reward.code import OUTPUT_SLACK_BYTES, output_matches

    assert output_matches(b"1 2  \n3\n\n\n", "1 2\n3")             # trailing blanks do not count
    assert output_matches("é\n".encode(), "é")
    assert not output_matches(b"\xff\n", "\ufffd")                # not decoded with replacement
    assert not output_matches(b"1\n2", "1 2")
    # far longer than expected: wrong before any split (a 32 MiB flood is never decoded)
    assert not output_matches(b"3" + b" " * (4 * 2 + OUTPUT_SLACK_BYTES), "3")
    assert output_matches(b"3" + b" " * 1000, "3")
