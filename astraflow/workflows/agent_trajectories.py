"""An agent episode's calls as trajectories.

Calls are taken in the order they arrived. A call whose prompt extends the previous trajectory's tokens
(the last call's prompt and completion, then what the program appended: a tool result, the user's next
message) joins that trajectory: the appended tokens are observations (loss mask 0, version -1) and its
completion is trained on, as the built-in multi-turn workflows record a conversation (`Transcript`). A
call whose prompt does not extend it (the program rewrote the history, or called another policy) starts
a new trajectory, as does one sampled otherwise (another temperature, top-k or top-p: the trainer scores
each trajectory through one processing). The episode's reward goes to the last trajectory; each earlier
one gets it times `discount` per trajectory after it.
"""

from __future__ import annotations

from collections.abc import Sequence

from astraflow.agents.recording import Call
from astraflow.messages import Trajectory
from astraflow.workflows.rlvr import processing
from astraflow.workflows.transcript import Transcript


def merged(calls: Sequence[Call]) -> list[tuple[str, Transcript, str]]:
    """(policy, transcript, finish reason) per trajectory, merging calls by prefix."""
    out: list[tuple[str, Transcript, str]] = []
    for call in sorted(calls, key=lambda c: c.seq):
        resp = call.response
        if out and out[-1][0] == call.model and _continues(call, out[-1][1]):
            record = out[-1][1]
            record.observed(call.prompt_ids[len(record.ids) :])
        else:
            record = Transcript(call.prompt_ids)
        record.sampled(resp, len(resp.token_ids))
        if out and out[-1][1] is record:
            out[-1] = (call.model, record, resp.finish_reason)
        else:
            out.append((call.model, record, resp.finish_reason))
    return out


def _continues(call: Call, record: Transcript) -> bool:
    """Whether `call` extends `record`: its prompt starts with the record's tokens, and it was sampled as
    the record's turns were (one trajectory is scored through one sampling processing)."""
    prompt, ids = call.prompt_ids, record.ids
    same = record.processing in (None, processing(call.response.sampling))
    return same and len(prompt) >= len(ids) and prompt[: len(ids)] == ids


def trajectories(
    calls: Sequence[Call],
    reward: float,
    discount: float = 1.0,
    error: str | None = None,
    metrics: dict[str, float] | None = None,
) -> list[Trajectory]:
    """The episode's trajectories, the last with `reward`, earlier ones discounted; every one carries
    `error` (a failed episode is not trained on) and `metrics`."""
    parts = merged(calls)
    n = len(parts)
    return [
        record.trajectory(model, reward * discount ** (n - 1 - i), finish, error, metrics)
        for i, (model, record, finish) in enumerate(parts)
    ]
