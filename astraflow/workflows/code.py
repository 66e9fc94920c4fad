"""`code`: the policy writes a Python function; the `code_tests` reward runs the sample's unit tests on it
in the tool sandbox (`sandbox.run_python`: a fresh isolated interpreter with CPU, memory and wall limits).

The reward is the share of the sample's `tests` (assert statements, or one block of test code) that pass.
A test that fails or raises counts as failed; the policy's code is at fault and is trained on. When the
sandbox stops the program (a limit hit, the interpreter killed or exited early) there is no result: the
reward raises with the sandbox's reason, so the trajectory gets 0.0 and that error, and is not trained on.
Limits: 2 s CPU, 256 MiB, 5 s wall (`raas.reward_timeout_s` must leave room for them).

The tests run in the solution's own (sandboxed) interpreter: the result line carries a fresh token so
ordinary output cannot pass for it, but code written to read the harness could fake it. The sandbox
contains such code; the reward does not defend against it.
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
# push the result line out of the capped output, and the line carries a token the solution never sees.
_HARNESS = """
import io, sys
_out, sys.stdout, sys.stderr = sys.stdout, io.StringIO(), io.StringIO()
_ns, _passed = {{"__name__": "solution"}}, 0
try:
    exec(compile({code!r}, "<solution>", "exec"), _ns)
    _loaded = True
except BaseException:
    _loaded = False
for _test in {tests!r} if _loaded else []:
    try:
        exec(compile(_test, "<test>", "exec"), _ns)
        _passed += 1
    except BaseException:
        pass
print({token!r}, _passed, file=_out, flush=True)
"""


class CodeSandboxError(RuntimeError):
    """The sandbox stopped the program before it reported its tests."""


def solution(completion: str) -> str:
    """The code of a completion: its first fenced block, else the completion as it is."""
    fenced = FENCE.search(completion)
    return fenced.group(1) if fenced else completion


@reward("code_tests")
def code_tests(prompt: str, completion: str, tests: Any = None, **sample: Any) -> float:
    """The share of `tests` that pass against the completion's code, run in the tool sandbox."""
    if isinstance(tests, str):
        tests = [tests]
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("code_tests: the sample has no `tests` (a list of test code strings)")
    token = secrets.token_hex(16)
    program = _HARNESS.format(code=solution(completion), tests=list(tests), token=token)
    result = asyncio.run(run_python(program, cpu_s=2, memory_mb=256, wall_s=5.0))
    found = re.search(re.escape(token) + r" (\d+)", result.output)
    if not result.ok or found is None:
        raise CodeSandboxError(f"sandbox: {result.output.strip()[-300:] or 'no result'}")
    return int(found.group(1)) / len(tests)


@workflow("code")
class Code(RLVR):
    """`rlvr` whose reward is `code_tests` unless the recipe's `reward` option or the sample names another;
    the sample carries `tests`. Options as `rlvr`'s."""

    def __init__(self, ctx: WorkflowContext) -> None:
        super().__init__(dataclasses.replace(ctx, options={"reward": "code_tests", **ctx.options}))
