-- Trainer: set a batch aside - a dead letter with the reason, its XACK, and the ledger moving its groups
-- from `trained` (counted when the batch was formed) to `dead` - in one atomic step. For a batch the
-- trainer refused (non-finite values, a step that was not finite) or that it died training too often.
-- The groups a batch replayed were trained before: only `replayed` is taken back for them.
-- The entry's fields in the errors hash are removed: its recorded error and its step attempts.
-- Keys, arguments and reply: `SET_ASIDE` in astraflow/dataflow/scripts.py.
local batches, dead, errors, ledger = Key.batches, Key.dead, Key.errors, Key.ledger
local group, consumer, id, model, reason = Arg.group, Arg.consumer, Arg.id, Arg.model, Arg.reason
local dead_maxlen, max_field_bytes = Arg.dead_maxlen, Arg.max_field_bytes

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
redis.call('HDEL', errors, Errors.entry(batches, id), Arg.attempts_field, Arg.error_field)

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
