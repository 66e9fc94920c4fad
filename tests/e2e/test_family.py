"""A workflow of the family in the real processes: `route` with a served-only large policy (`train: false`),
every answer handed off. The large policy's trajectories go into no batch; the small one trains on the
large one's accuracy minus the hand-off cost."""

import pytest

from tests.e2e.test_launcher import rewards, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


def test_route_hands_off_to_a_served_only_policy_and_trains_the_small_one(tmp_path):
    run_dir = tmp_path / "run"
    options = '{chat: false, handoff: "", handoff_cost: 0.5}'  # an empty marker: every answer hands off
    sets = [
        "run.max_steps=5",
        "run.models={small: {}, large: {train: false}}",
        "dataflow.feeder.workflow=route",
        f"raas.workflow_options={options}",
    ]
    summary = run(run_dir, "e2e-route", *sets)
    assert summary["stopped"] == "5 steps" and summary["ledger"]["balanced"], summary
    assert list(summary["models"]) == ["small"]  # the large policy serves, nothing trains it
    # The warm-started large model gets about a quarter right: the small policy's reward is that minus the
    # cost, below zero, where a small policy scored on its own answers would be in [0, 1].
    r = rewards(run_dir, "small")
    assert len(r) >= 5 and all(-0.5 <= x < 0 for x in r), r
