"""What the other ranks of a trainer receive of each command rank 0 posts (`trainer.commands`)."""

from astraflow.trainer import commands
from astraflow.trainer.checkpoint import TrainerState


def test_followers_get_a_restores_schedule_and_rngs_not_its_tensors():
    restore = commands.Restore(TrainerState(version=3), {"w": 1}, {"adam": 2}, {"lr": 3}, [{"cpu": 4}])
    shared = restore.for_followers()
    assert (shared.state, shared.model_state, shared.optim_state) == (None, {}, {})
    assert (shared.sched_state, shared.rngs) == ({"lr": 3}, [{"cpu": 4}])
    assert restore.model_state == {"w": 1}  # rank 0 keeps what it loads and shards


def test_a_command_without_fields_travels_as_its_name():
    train = commands.Train(batch=None, version=2)  # type: ignore[arg-type]
    assert train.for_followers() is train
    for cls in (commands.PublicationState, commands.RngState, commands.FullState, commands.Stop):
        assert cls().for_followers() is None
        assert commands.COMMANDS[cls.NAME] is cls  # what a follower rebuilds from the name
    assert len(commands.COMMANDS) == len(set(commands.COMMANDS.values()))
