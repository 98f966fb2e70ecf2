"""Small coding tasks and their grader.

A task asks for ``solution.py`` defining one function. Its hidden test cases stay in this
(trusted) process: the grader sends only the *inputs* into the sandbox, where a short harness
imports the solution and prints what the function returned, and the outputs are compared here.
The sandbox cannot read this file (Landlock allows reading only the system's folders), so a
solution cannot look the expected answers up.
"""

from __future__ import annotations

import json
import secrets
import shlex
from dataclasses import dataclass, field
from typing import Any

from miles_env_terminal.sandbox import RunResult, Sandbox


@dataclass(frozen=True)
class Task:
    """One coding task: what the agent is told, and the hidden ``(args, expected)`` cases."""

    task_id: str
    function: str
    signature: str
    description: str
    cases: tuple[tuple[tuple[Any, ...], Any], ...]

    @property
    def prompt(self) -> str:
        """The instruction the agent receives."""
        return (
            "You are in a Linux shell, in an empty working directory. Using shell commands, "
            f"create the file solution.py defining `{self.signature}`: {self.description} "
            "Only the Python standard library is available and there is no network. Hidden "
            "tests will import solution.py and call the function."
        )


TASKS: dict[str, Task] = {
    t.task_id: t
    for t in (
        Task(
            "add",
            "add",
            "add(a, b)",
            "return the sum of the two integers a and b.",
            (((1, 2), 3), ((-5, 5), 0), ((10**12, 1), 10**12 + 1), ((0, 0), 0), ((-3, -4), -7)),
        ),
        Task(
            "reverse",
            "reverse_string",
            "reverse_string(s)",
            "return the string s reversed.",
            (
                (("abc",), "cba"),
                (("",), ""),
                (("racecar",), "racecar"),
                (("Hello, World",), "dlroW ,olleH"),
            ),
        ),
        Task(
            "fizzbuzz",
            "fizzbuzz",
            "fizzbuzz(n)",
            "return a list of strings for the numbers 1..n: 'Fizz' for multiples of 3, 'Buzz' "
            "for multiples of 5, 'FizzBuzz' for multiples of both, else the number itself.",
            (
                ((1,), ["1"]),
                ((5,), ["1", "2", "Fizz", "4", "Buzz"]),
                (
                    (15,),
                    [
                        "1",
                        "2",
                        "Fizz",
                        "4",
                        "Buzz",
                        "Fizz",
                        "7",
                        "8",
                        "Fizz",
                        "Buzz",
                        "11",
                        "Fizz",
                        "13",
                        "14",
                        "FizzBuzz",
                    ],
                ),
                ((0,), []),
            ),
        ),
        Task(
            "parse_ints",
            "parse_ints",
            "parse_ints(line)",
            "return the list of the (possibly negative) integers that appear in the text line, "
            "in order; a '-' directly before digits makes the number negative.",
            (
                (("a1 b-2 33",), [1, -2, 33]),
                (("no numbers",), []),
                (("x=10,y=-20;z=007",), [10, -20, 7]),
                (("-5",), [-5]),
            ),
        ),
        Task(
            "palindrome",
            "is_palindrome",
            "is_palindrome(s)",
            "return True when s reads the same backwards, ignoring case and every character "
            "that is not a letter or a digit, else False.",
            (
                (("A man, a plan, a canal: Panama",), True),
                (("hello",), False),
                (("",), True),
                (("No 'x' in Nixon",), True),
                (("ab",), False),
            ),
        ),
        Task(
            "word_count",
            "word_count",
            "word_count(text)",
            "return a dict mapping each lowercased word (runs of letters a-z) of text to how "
            "many times it occurs.",
            (
                (("the cat the hat",), {"the": 2, "cat": 1, "hat": 1}),
                (("",), {}),
                (("Go go GO!",), {"go": 3}),
            ),
        ),
        Task(
            "max_subarray",
            "max_subarray",
            "max_subarray(nums)",
            "return the largest sum of a non-empty contiguous run of the non-empty list of "
            "integers nums.",
            (
                (([1, -2, 3, 4, -1],), 7),
                (([-3, -1, -2],), -1),
                (([5],), 5),
                (([2, -1, 2, -1, 2],), 4),
            ),
        ),
        Task(
            "roman",
            "roman_to_int",
            "roman_to_int(s)",
            "return the integer value of the Roman numeral s (I, V, X, L, C, D, M, with the "
            "subtractive forms such as IV and CM).",
            ((("III",), 3), (("IV",), 4), (("MCMXCIV",), 1994), (("LVIII",), 58)),
        ),
    )
}

# Runs inside the sandbox; gets the function name, the inputs and a nonce, never the answers.
_HARNESS = r"""
import json, sys
sys.path.insert(0, ".")
name, cases, nonce = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
out = []
try:
    import solution
    fn = getattr(solution, name)
except BaseException as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    print("\n" + nonce, json.dumps({"import_error": repr(e)[:300]}), flush=True)
    sys.exit(0)
for args in cases:
    try:
        out.append({"ok": fn(*args)})
    except BaseException as e:
        # the message (with the path or errno) goes to stderr, where the sandbox's
        # classifier records the limit the solution ran into
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        out.append({"error": repr(e)[:300]})
print("\n" + nonce, json.dumps(out, default=repr), flush=True)
"""


@dataclass
class GradeReport:
    """The outcome of grading: ``grade`` is the fraction of cases passed, 0 on a violation."""

    task_id: str
    grade: float
    passed: int
    total: int
    violations: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "task_id": self.task_id,
            "grade": self.grade,
            "passed": self.passed,
            "total": self.total,
            "violations": list(self.violations),
            "details": list(self.details),
        }


def _canonical(value: Any) -> str:
    # compared as canonical JSON so that True and 1, or 3.0 and 3, do not pass for each other
    return json.dumps(json.loads(json.dumps(value, default=repr)), sort_keys=True)


def run_hidden_tests(task: Task, sandbox: Sandbox, *, python: str = "python3") -> GradeReport:
    """Run the task's hidden cases against ``solution.py`` in the sandbox's directory and
    compare the outputs here. Violations during the test run (timeout, network, ...) make the
    grade 0."""
    nonce = "MILES-RESULT-" + secrets.token_hex(8)
    inputs = json.dumps([list(args) for args, _ in task.cases])
    command = " ".join(
        shlex.quote(part) for part in (python, "-c", _HARNESS, task.function, inputs, nonce)
    )
    result: RunResult = sandbox.run(command)
    report = GradeReport(task.task_id, 0.0, 0, len(task.cases), list(result.violations))
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(nonce + " ")]
    if not lines:
        report.details.append(
            f"no test output (exit {result.exit_code}): {result.stderr.strip()[-300:]}"
        )
        return report
    try:
        outputs = json.loads(lines[-1][len(nonce) + 1 :])
    except json.JSONDecodeError:
        report.details.append("malformed test output")
        return report
    if isinstance(outputs, dict):
        report.details.append(f"import failed: {outputs.get('import_error')}")
        return report
    for i, ((args, expected), got) in enumerate(zip(task.cases, outputs, strict=False)):
        if isinstance(got, dict) and "ok" in got and _canonical(got["ok"]) == _canonical(expected):
            report.passed += 1
        else:
            report.details.append(f"case {i} {args!r}: got {got!r}")
    if not report.violations:
        report.grade = report.passed / report.total
    return report
