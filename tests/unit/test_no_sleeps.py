"""The rule that tests wait on conditions, not on sleeps, checked over every file under
tests/: a call to time.sleep or asyncio.sleep (or a bare ``sleep`` imported from either)
is allowed only in tests/waiting.py, the polling helper, and on a line marked
``# workload:`` with the reason the sleep is the work under test rather than a wait
(a deliberately slow client, a hook that stands in for slow work), or ``# unobservable:``
naming the figure the code under test does not expose, without which the condition
cannot be waited for (each one is a gap to close in that code, not in the test)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HELPER = TESTS / "waiting.py"
MARKS = ("# workload:", "# unobservable:")


def unmarked_sleeps(source: str) -> list[int]:
    """The lines of ``source`` with a sleep call that carries none of MARKS (on the call's
    first or last line)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    bare = set()  # names bound to a sleep by ``from time import sleep [as x]``
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio"):
            bare.update(alias.asname or alias.name for alias in node.names if alias.name == "sleep")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        is_sleep = (isinstance(f, ast.Attribute) and f.attr == "sleep" and isinstance(f.value, ast.Name)
                    and f.value.id in ("time", "asyncio")) or (isinstance(f, ast.Name) and f.id in bare)
        if is_sleep and not any(mark in lines[n - 1] for mark in MARKS
                                for n in {node.lineno, node.end_lineno or node.lineno}):
            found.append(node.lineno)
    return sorted(found)


def test_the_checker_finds_unmarked_sleeps_and_passes_marked_ones():
    source = (
        "import time, asyncio\n"
        "from time import sleep as nap\n"
        "time.sleep(1)\n"
        "time.sleep(1)  # workload: a slow client\n"
        "time.sleep(1)  # unobservable: no figure says so\n"
        "async def f():\n"
        "    await asyncio.sleep(0.1)\n"
        "nap(2)\n"
        "loop.run_until_complete(asyncio.sleep(0))\n"
        "event.wait(1)\n"
    )
    assert unmarked_sleeps(source) == [3, 7, 8, 9]


def test_no_test_sleeps_in_place_of_waiting_on_a_condition():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == HELPER or ".venv" in path.parts:
            continue
        for line in unmarked_sleeps(path.read_text()):
            offenders.append(f"{path.relative_to(TESTS.parent)}:{line}")
    assert not offenders, (
        "sleeps under tests/ that are not workload: wait on the condition with tests.waiting.wait_for, "
        "or mark a sleep that is the work under test with '# workload: <why>':\n  " + "\n  ".join(offenders))
