-- Version barrier, first half: record that a model's trainer published a version, with the XACK.
-- Recording is idempotent (the version only moves forward), so a retried call changes nothing.
-- KEYS[1] versions stream, KEYS[2] state
-- ARGV: group, consumer, entry_id, model, version, manifest_key, eval ('1'/'0'), checkpoint
-- Returns 'ok', 'dup' or 'lost'.
local versions, state = KEYS[1], KEYS[2]
local group, consumer, id, model, version = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local status = ownership(versions, group, consumer, id)
if status ~= 'ok' then return status end
if version > trainer_version(state, model) or not redis.call('HGET', state, 'v:' .. model) then
  redis.call('HSET', state, 'v:' .. model, version)
end
redis.call('HSET', state, 'manifest:' .. model .. ':' .. version, ARGV[6], 'checkpoint:' .. model .. ':' .. version, ARGV[8])
if ARGV[7] == '1' then redis.call('HSET', state, 'eval:' .. version, 1) end
redis.call('XACK', versions, group, id)
return 'ok'
