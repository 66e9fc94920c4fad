-- Hand-off: acknowledge consumed entries and publish their outputs in one atomic step.
--
-- Each item is (input entry id or '' for a plain publish, outputs). An input is acknowledged only by the
-- consumer that owns it in the group's pending list: a consumer whose entry was reclaimed by another
-- gets 'lost' and nothing of that item is written. That check alone makes a hand-off exactly-once: a
-- retried call (the reply was lost) finds its input acknowledged and writes nothing ('dup'). An output
-- with a dedup key is written at most once while the key lives, whichever entry or call produces it.
-- Every check runs before the first write: Redis does not roll back a script that fails half-way.
--
-- An item may also settle a prompt group as dead (its entry is being dead-lettered): the group's uid
-- leaves the in-flight set and, if it was there, the ledger counts it dead - once, whoever retries.
--
-- KEYS[1] input stream (any key of the run when there is none), KEYS[2] errors hash, KEYS[3] in-flight
-- set, KEYS[4] ledger hash, KEYS[5..] output streams and dedup keys, referenced by index from ARGV.
-- ARGV: group, consumer, dedup_ttl_ms, n_items, then per item:
--   input_id, dead_uid ('' = none), n_outputs, then per output: stream_index, dedup_index (0 = none),
--   n_fields, f1, v1, ...
-- An acknowledged input's recorded error (errors hash, written by release and claim) is removed with it.
-- Returns one reply per item: {status, id of each output ('' when unknown)}; status 'ok', 'dup' (already
-- done: every output existed, or the input was already acknowledged) or 'lost' (another consumer has it).

local input, errors, in_flight, ledger = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, consumer, ttl, n_items = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])

-- Pass 1, read-only: every output stream must be a stream (or not exist yet).
local checked, pos = {}, 5
for _ = 1, n_items do
  local n_out = tonumber(ARGV[pos + 2])
  pos = pos + 3
  for _ = 1, n_out do
    local stream, n_fields = KEYS[tonumber(ARGV[pos])], tonumber(ARGV[pos + 2])
    if n_fields < 1 or n_fields > 1000 then
      return redis.error_reply('ERR output to ' .. stream .. ' has ' .. n_fields .. ' fields (1 to 1000)')
    end
    if not checked[stream] then
      local t = redis.call('TYPE', stream)
      if type(t) == 'table' then t = t['ok'] end
      if t ~= 'stream' and t ~= 'none' then
        return redis.error_reply('WRONGTYPE output ' .. stream .. ' is a ' .. t .. ', not a stream')
      end
      checked[stream] = true
    end
    pos = pos + 3 + 2 * n_fields
  end
end

-- Pass 2: per item, decide and write.
local replies = {}
pos = 5
for i = 1, n_items do
  local id, dead_uid, n_out = ARGV[pos], ARGV[pos + 1], tonumber(ARGV[pos + 2])
  pos = pos + 3
  local owned = id == '' or #redis.call('XPENDING', input, group, id, id, 1, consumer) > 0
  local reply, first, all_done = {'ok'}, pos, n_out > 0
  for j = 1, n_out do
    local dedup = tonumber(ARGV[pos + 1])
    local existing = dedup > 0 and redis.call('GET', KEYS[dedup])
    reply[j + 1] = existing or ''
    all_done = all_done and existing ~= false
    pos = pos + 3 + 2 * tonumber(ARGV[pos + 2])
  end
  if all_done or (not owned and #redis.call('XPENDING', input, group, id, id, 1) == 0) then
    reply[1] = 'dup'
  elseif not owned then
    reply[1] = 'lost'
  end
  if owned then
    local p = first
    for j = 1, n_out do
      local n_fields = tonumber(ARGV[p + 2])
      if reply[j + 1] == '' then
        local dedup = tonumber(ARGV[p + 1])
        local new_id = redis.call('XADD', KEYS[tonumber(ARGV[p])], '*', unpack(ARGV, p + 3, p + 2 + 2 * n_fields))
        if dedup > 0 then redis.call('SET', KEYS[dedup], new_id, 'PX', ttl) end
        reply[j + 1] = new_id
      end
      p = p + 3 + 2 * n_fields
    end
    if dead_uid ~= '' and redis.call('SREM', in_flight, dead_uid) == 1 then
      redis.call('HINCRBY', ledger, 'dead', 1)
    end
    if id ~= '' then
      redis.call('XACK', input, group, id)
      redis.call('HDEL', errors, input .. '|' .. id)
    end
  end
  replies[i] = reply
end
return replies
