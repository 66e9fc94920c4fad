-- Trainer: set a batch aside - a dead letter with the reason, its XACK, and the ledger moving its groups
-- from `trained` (counted when the batch was formed) to `dead` - in one atomic step. For a batch the
-- trainer refused (non-finite values, a step that was not finite) or that it died training too often.
-- The groups a batch replayed were trained before: only `replayed` is taken back for them.
-- KEYS[1] batches stream, KEYS[2] dead stream, KEYS[3] errors hash (the entry's fields are removed: its
-- recorded error and its step attempts), KEYS[4] ledger
-- ARGV: group, consumer, entry_id, model, reason, dead_maxlen, max_field_bytes, attempts_field, error_field
-- Returns 'ok', 'dup' (already settled: a retry) or 'lost' (another consumer owns it now, or a
-- failover lost it).
local batches, dead, errors, ledger = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, consumer, id, model, reason = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local dead_maxlen, max_field_bytes = ARGV[6], tonumber(ARGV[7])

local status = ownership(batches, group, consumer, id)
if status ~= 'ok' then return status end
local entry = redis.call('XRANGE', batches, id, id)[1]
local fields = {Entry.kind, DeadLetter.kind, DeadLetter.source, batches, DeadLetter.source_id, id,
                DeadLetter.group, group, DeadLetter.consumer, consumer, DeadLetter.reason, reason}
local headers = {}
if entry then
  for i = 1, #entry[2], 2 do
    local name, value = entry[2][i], entry[2][i + 1]
    headers[name] = value
    fields[#fields + 1] = DeadLetter.copied(name)
    fields[#fields + 1] = #value <= max_field_bytes and value or ('omitted: ' .. #value .. ' bytes')
  end
end
redis.call('XADD', dead, 'MAXLEN', '~', dead_maxlen, '*', unpack(fields))
redis.call('XACK', batches, group, id)
redis.call('HDEL', errors, Errors.entry(batches, id), ARGV[8], ARGV[9])

local replayed, fresh = {}, 0
for uid in string.gmatch(headers[BatchEntry.replayed] or '', '%S+') do replayed[uid] = true end
local n_replayed = 0
for uid in string.gmatch(headers[BatchEntry.groups] or '', '%S+') do
  if replayed[uid] then n_replayed = n_replayed + 1 else fresh = fresh + 1 end
end
if fresh > 0 then
  redis.call('HINCRBY', ledger, Counters.model_trained(model), -fresh)
  redis.call('HINCRBY', ledger, Counters.model_dead(model), fresh)
end
if n_replayed > 0 then redis.call('HINCRBY', ledger, Counters.model_replayed(model), -n_replayed) end
return 'ok'
