-- Claim pending entries for `consumer`, and dead-letter those already delivered max_deliveries times.
-- Three modes:
--   'others': entries of other consumers idle longer than the lease (their owner stopped renewing, or
--             released them). Counts a delivery.
--   'own':    this consumer's own pending entries after `start`, except the ids it says it still holds.
--             Counts a delivery only for an entry delivered before `since` (Redis time in ms when this
--             consumer started: it was delivered to a previous process under the same name, which
--             crashed) or released (idle set to RELEASED_IDLE by release.lua: its handler failed). Both
--             times are Redis's, so no clock skew or latency enters. One the consumer merely lost track of
--             in this process (a lost reply, a hand-off that failed while Redis was away) is not a new
--             delivery: the attempt did not fail, so it neither counts nor dead-letters.
--   'reap':   claims nothing: dead-letters the entries of any consumer idle longer than the lease and
--             delivered max_deliveries times (the dataflow, for the consumers of a stream that may not).
-- A claim that would count a delivery past max_deliveries dead-letters the entry instead, when its caller
-- hands the keys to (`Key.settle`: the dead stream, the in-flight set, the ledger); without them it
-- leaves the entry pending for a 'reap' (a RaaS: its user may write none of the three).
-- A counted claim of an entry that was not released records why the last attempt ended in the errors
-- hash, so a dead letter says what happened.
-- XPENDING + XCLAIM rather than XAUTOCLAIM or XREADGROUP <id>: it tells the last owner and the delivery
-- count before the claim (both go into a dead letter), never counts an in-flight entry as redelivered,
-- and behaves the same on Redis 6.2 and 7.x for entries deleted from the stream (acknowledged here,
-- since nothing is left to process).
-- Dead-lettering an entry of a tracked stream (one prompt group per entry) also settles its group (the
-- uid its `data` starts with, `entry_uid`; never the plain `uid` field): the uid leaves the in-flight set
-- and the ledger counts it dead.
-- Keys, arguments and reply: `CLAIM` in astraflow/streams/scripts.py. Larger fields of a dead letter than
-- `max_field_bytes` are replaced by their size and digest.
local stream, errors, settle = Key.stream, Key.errors, Key.settle[1]
local mode, group, consumer, min_idle, start = Arg.mode, Arg.group, Arg.consumer, Arg.min_idle, Arg.start
local count, max_deliveries, dead_maxlen, tracked = Arg.count, Arg.max_deliveries, Arg.dead_maxlen, Arg.tracked
local max_field_bytes = Arg.max_field_bytes
if mode == 'reap' and not settle then
  return redis.error_reply('ERR claim: reap needs the dead, in_flight and ledger keys')
end
local MAX_COPIED_FIELDS = 200  -- fields of the original entry copied into a dead letter

local skip = {}
for _, id in ipairs(Arg.skip) do skip[id] = true end

local pending, since, now
if mode == 'own' then
  local t = redis.call('TIME')
  since, now = tonumber(min_idle), tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  pending = redis.call('XPENDING', stream, group, start, '+', count, consumer)
else
  pending = redis.call('XPENDING', stream, group, 'IDLE', min_idle, start, '+', count)
end

-- A field of a dead letter: the original value, or when larger than `limit` its size and digest (the
-- same text as Bus.dead_field_value writes).
local function dead_field_value(value, limit)
  if #value <= limit then return value end
  if not redis.sha1hex then return 'omitted: ' .. #value .. ' bytes' end  -- (fakeredis lacks it)
  return 'omitted: ' .. #value .. ' bytes, sha1 ' .. redis.sha1hex(value)
end

local function dead_letter(id, entry, owner, deliveries, last)
  local reason = 'delivered ' .. deliveries .. ' times (max_deliveries ' .. max_deliveries .. '); '
  if last then
    reason = reason .. 'last error: ' .. last
  else
    reason = reason .. 'never acknowledged: its owners crashed or hung past the lease'
  end
  local uid = tracked and entry_uid(entry[2])
  local fields = {Entry.kind, DeadLetter.kind, DeadLetter.source, stream, DeadLetter.source_id, id,
                  DeadLetter.group, group, DeadLetter.consumer, owner,
                  DeadLetter.deliveries, tostring(deliveries), DeadLetter.reason, reason}
  if uid then
    fields[#fields + 1] = DeadLetter.settled
    fields[#fields + 1] = uid
  end
  local n_copied = math.min(#entry[2], 2 * MAX_COPIED_FIELDS)
  for i = 1, n_copied, 2 do
    fields[#fields + 1] = DeadLetter.copied(entry[2][i])
    fields[#fields + 1] = dead_field_value(entry[2][i + 1], max_field_bytes)
  end
  if n_copied < #entry[2] then
    fields[#fields + 1] = DeadLetter.fields_truncated
    fields[#fields + 1] = tostring(#entry[2] / 2)
  end
  redis.call('XADD', settle.dead, 'MAXLEN', '~', dead_maxlen, '*', unpack(fields))
  if uid and redis.call('SREM', settle.in_flight, uid) == 1 then
    redis.call('HINCRBY', settle.ledger, Counters.dead, 1)
  end
end

local claimed = {''}
if #pending == count and pending[#pending][1] ~= LAST_ID then
  claimed[1] = '(' .. pending[#pending][1]
end
for _, p in ipairs(pending) do
  local id, owner, idle, deliveries = p[1], p[2], tonumber(p[3]), tonumber(p[4])
  local released = idle >= RELEASED_IDLE
  -- (1 ms of slack: idle times and TIME are rounded differently)
  local counted = mode ~= 'own' or released or now - idle < since - 1
  local due = counted and deliveries >= max_deliveries  -- for `dead`, not another delivery
  local mine = mode == 'own' or (mode == 'others' and owner ~= consumer)
  if not skip[id] and ((mine and (settle or not due)) or (mode == 'reap' and due)) then
    local entry = redis.call('XRANGE', stream, id, id)[1]
    local err_field = Errors.entry(stream, id)
    local why = nil  -- how the last attempt ended, when this claim is what tells
    if counted and not released then
      why = owner .. (mode == 'own' and ' restarted (crashed) before acknowledging it'
        or ' stopped renewing its lease (crashed or hung)')
    end
    if not entry then
      redis.call('XACK', stream, group, id)
      redis.call('HDEL', errors, err_field)
    elseif due then
      dead_letter(id, entry, owner, deliveries, why or redis.call('HGET', errors, err_field))
      redis.call('XACK', stream, group, id)
      redis.call('HDEL', errors, err_field)
      if mode == 'reap' then claimed[#claimed + 1] = {id, deliveries} end
    else
      if why then redis.call('HSET', errors, err_field, why) end
      -- JUSTID alone would not count a delivery; RETRYCOUNT does. Both reset the idle time.
      local times = counted and deliveries + 1 or deliveries
      redis.call('XCLAIM', stream, group, consumer, 0, id, 'RETRYCOUNT', times, 'JUSTID')
      local reply = {id, times}
      for _, v in ipairs(entry[2]) do reply[#reply + 1] = v end
      claimed[#claimed + 1] = reply
    end
  end
end
return claimed
