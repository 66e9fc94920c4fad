-- Version barrier, first half: record that a model's trainer published a version, with the XACK.
-- Recording is idempotent (the version only moves forward), so a retried call changes nothing - except
-- for a rollback: a new trainer incarnation publishing a version older than the recorded one (it
-- restarted from a checkpoint behind the versions its predecessor announced, whose weights are gone).
-- The version then moves back and `rollback` asks the next announcement to go out although it is not new.
-- A version more than max_step past the model's recorded one is refused ('far', nothing recorded, the
-- entry left to the caller to dead-letter): a forged entry at v = 10^9 would make every rollout stale.
-- Keys, arguments and reply: `VERSION` in astraflow/dataflow/scripts.py.
local versions, state, errors = Key.versions, Key.state, Key.errors
local group, consumer, id, model, version = Arg.group, Arg.consumer, Arg.id, Arg.model, Arg.version
local status = ownership(versions, group, consumer, id)
if status ~= 'ok' then return status end
local recorded = redis.call('HGET', state, State.version(model))
if recorded and version > trainer_version(state, model) + Arg.max_step then return 'far' end
local incarnation = redis.call('HGET', state, State.incarnation(model))
if incarnation and incarnation ~= Arg.incarnation and version < trainer_version(state, model) then
  redis.call('HSET', state, State.version(model), version, State.rollback, 1)
elseif version > trainer_version(state, model) or not redis.call('HGET', state, State.version(model)) then
  redis.call('HSET', state, State.version(model), version)
end
redis.call('HSET', state, State.incarnation(model), Arg.incarnation)
redis.call('HSET', state, State.manifest(model, version), Arg.manifest_key, State.checkpoint(model, version),
  Arg.checkpoint)
if Arg.eval then redis.call('HSET', state, State.eval(version), 1) end
redis.call('XACK', versions, group, id)
redis.call('HDEL', errors, Errors.entry(versions, id))
return 'ok'
