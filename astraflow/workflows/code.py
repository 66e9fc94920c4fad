"""`code`: the policy writes a Python function; the `code_tests` reward runs the sample's unit tests on it
in the tool sandbox (`sandbox.run_python`: a fresh isolated interpreter with CPU, memory and wall limits).

The reward is the share of the sample's `tests` (assert statements, or one block of test code) that pass.
A test that fails or raises counts as failed; the policy's code is at fault and is trained on. When the
sandbox stops the program (a limit hit, the interpreter killed or exited early) there is no result: the
reward raises with the sandbox's reason, so the trajectory gets 0.0 and that error, and is not trained on.
Limits: 2 s CPU, 256 MiB, 5 s wall (`raas.reward_timeout_s` must leave room for them).

The tests run in the solution's own (sandboxed) interpreter, which reports one verdict line per test
that passed (`<token> pass <index>`); the share is computed here, outside that process, from the distinct
indices of the sample's tests. Code that rewrites the harness's state can at worst make tests it failed
look passed - the reward stays in [0, 1] - and the result lines carry a fresh token so ordinary output
cannot pass for them. The sandbox contains such code; the reward does not defend against it further.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import secrets
from typing import Any

from astraflow.workflows.api import WorkflowContext, reward, workflow
from astraflow.workflows.rlvr import RLVR
from astraflow.workflows.sandbox import run_python

FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)

# Runs the solution, then each test, in one namespace; the solution's own output is swallowed so it cannot
# push the verdicts out of the capped output, and each verdict carries a token the solution never sees.
# No count is kept in the process: a verdict line per passed test, counted by the reward.
_HARNESS = """
import io, sys
_out, sys.stdout, sys.stderr = sys.stdout, io.StringIO(), io.StringIO()
_ns = {{"__name__": "solution"}}
try:
    exec(compile({code!r}, "<solution>", "exec"), _ns)
    _loaded = True
except BaseException:
    _loaded = False
for _index, _test in enumerate({tests!r} if _loaded else []):
    try:
        exec(compile(_test, "<test>", "exec"), _ns)
        print({token!r}, "pass", _index, file=_out, flush=True)
    except BaseException:
        pass
print({token!r}, "done", file=_out, flush=True)
"""


class CodeSandboxError(RuntimeError):
    """The sandbox stopped the program before it reported its tests."""


def solution(completion: str) -> str:
    """The code of a completion: its first fenced block, else the completion as it is."""
    fenced = FENCE.search(completion)
    return fenced.group(1) if fenced else completion


@reward("code_tests", tools=True)
def code_tests(prompt: str, completion: str, tests: Any = None, **sample: Any) -> float:
    """The share of `tests` that pass against the completion's code, run in the tool sandbox."""
    if isinstance(tests, str):
        tests = [tests]
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("code_tests: the sample has no `tests` (a list of test code strings)")
    token = secrets.token_hex(16)
    program = _HARNESS.format(code=solution(completion), tests=list(tests), token=token)
    room = (len(token) + 16) * (len(tests) + 1)  # every verdict line fits in the output kept
    result = asyncio.run(run_python(program, cpu_s=2, memory_mb=256, wall_s=5.0, max_output_chars=room))
    lines = result.output.splitlines()
    if not result.ok or f"{token} done" not in lines:
        raise CodeSandboxError(f"sandbox: {result.output.strip()[-300:] or 'no result'}")
    return passed(lines, token, len(tests)) / len(tests)


def passed(lines: list[str], token: str, n_tests: int) -> int:
    """How many of the `n_tests` tests have a verdict line (each index once, only indices of the tests):
    at most `n_tests`, whatever the solution's process printed."""
    verdict = re.compile(re.escape(token) + r" pass (\d{1,9})")
    found = {int(m.group(1)) for line in lines if (m := verdict.fullmatch(line))}
    return len(found & set(range(n_tests)))


@workflow("code")
class Code(RLVR):
    """`rlvr` whose reward is `code_tests` unless the recipe's `reward` option or the sample names another;
    the sample carries `tests`. Options as `rlvr`'s."""

    def __init__(self, ctx: WorkflowContext) -> None:
        super().__init__(dataclasses.replace(ctx, options={"reward": "code_tests", **ctx.options}))
