-- Version barrier, first half: record that a model's trainer published a version, with the XACK.
-- Recording is idempotent (the version only moves forward), so a retried call changes nothing - except
-- for a rollback: a new trainer incarnation publishing a version older than the recorded one (it
-- restarted from a checkpoint behind the versions its predecessor announced, whose weights are gone).
-- The version then moves back and `rollback` asks the next announcement to go out although it is not new.
-- A version more than max_step past the model's recorded one is refused ('far', nothing recorded, the
-- entry left to the caller to dead-letter): a forged entry at v = 10^9 would make every rollout stale.
-- KEYS[1] versions stream, KEYS[2] state, KEYS[3] errors hash (the entry's recorded error is removed)
-- ARGV: group, consumer, entry_id, model, version, manifest_key, eval ('1'/'0'), checkpoint, incarnation,
--       max_step
-- Returns 'ok', 'dup', 'lost' or 'far'.
local versions, state, errors = KEYS[1], KEYS[2], KEYS[3]
local group, consumer, id, model, version = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local status = ownership(versions, group, consumer, id)
if status ~= 'ok' then return status end
local recorded = redis.call('HGET', state, State.version(model))
if recorded and version > trainer_version(state, model) + tonumber(ARGV[10]) then return 'far' end
local incarnation = redis.call('HGET', state, State.incarnation(model))
if incarnation and incarnation ~= ARGV[9] and version < trainer_version(state, model) then
  redis.call('HSET', state, State.version(model), version, State.rollback, 1)
elseif version > trainer_version(state, model) or not redis.call('HGET', state, State.version(model)) then
  redis.call('HSET', state, State.version(model), version)
end
redis.call('HSET', state, State.incarnation(model), ARGV[9])
redis.call('HSET', state, State.manifest(model, version), ARGV[6], State.checkpoint(model, version), ARGV[8])
if ARGV[7] == '1' then redis.call('HSET', state, State.eval(version), 1) end
redis.call('XACK', versions, group, id)
redis.call('HDEL', errors, Errors.entry(versions, id))
return 'ok'
