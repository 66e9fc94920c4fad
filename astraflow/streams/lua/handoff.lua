-- Hand-off: acknowledge consumed entries and publish their outputs in one atomic step.
--
-- Each item is (input entry id or '' for a plain publish, outputs). An input is acknowledged only by the
-- consumer that owns it in the group's pending list: a consumer whose entry was reclaimed by another
-- gets 'lost' and nothing of that item is written. That check alone makes a hand-off exactly-once: a
-- retried call (the reply was lost) finds its input acknowledged and writes nothing ('dup'). An output
-- with a dedup key is written at most once while the key lives. Its marker (the dedup key) holds the
-- output's id and, for an item with an input, the binding the caller computed: a digest of the input and
-- the output's fields. Such an output counts as written only when the marker holds the same binding: a
-- marker someone else wrote (a guessed key) is ignored and replaced, and reported, rather than answering
-- 'dup' and acknowledging an input whose output was never written. A plain publish (no input) has
-- nothing to bind to: any marker of its key counts (a trainer restarted with another incarnation
-- announces a version once).
-- Every check runs before the first write: Redis does not roll back a script that fails half-way.
--
-- An item may also settle a prompt group as dead (its entry is being dead-lettered): the group's uid
-- leaves the in-flight set and, if it was there, the ledger counts it dead - once, whoever retries.
--
-- KEYS[1] input stream (any key of the run when there is none), KEYS[2] errors hash, KEYS[3] in-flight
-- set, KEYS[4] ledger hash, KEYS[5..] output streams and dedup keys, referenced by index from ARGV.
-- ARGV: group, consumer, dedup_ttl_ms, n_items, then per item:
--   input_id, dead_uid ('' = none), n_outputs, then per output: stream_index, dedup_index (0 = none),
--   binding ('' = none), n_fields, f1, v1, ...
-- An acknowledged input's recorded error (errors hash, written by release and claim) is removed with it.
-- Returns {replies, ignored}: one reply per item, {status, id of each output ('' when unknown)}, status
-- 'ok', 'dup' (already done: every output existed, or the input was already acknowledged) or 'lost'
-- (another consumer has it, or this server never delivered it: the read was lost in a failover); and the
-- dedup keys whose markers were ignored (not this hand-off's).

local input, errors, in_flight, ledger = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, consumer, ttl, n_items = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])

-- Pass 1, read-only: every output stream must be a stream (or not exist yet); the lowest and highest
-- input ids.
local checked, pos, lo, hi = {}, 5, nil, nil
for _ = 1, n_items do
  local id, n_out = ARGV[pos], tonumber(ARGV[pos + 2])
  if id ~= '' then
    local key = {string.match(id, '^(%d+)-(%d+)$')}
    if #key ~= 2 then return redis.error_reply('ERR input id ' .. id .. ' is not a stream id') end
    key[3] = id
    if not lo or id_before(key, lo) then lo = key end
    if not hi or id_before(hi, key) then hi = key end
  end
  pos = pos + 3
  for _ = 1, n_out do
    local stream, n_fields = KEYS[tonumber(ARGV[pos])], tonumber(ARGV[pos + 3])
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
    pos = pos + 4 + 2 * n_fields
  end
end

-- What `consumer` owns among the inputs: one scan of its pending entries between the lowest and the
-- highest input id (it holds few others there: what it is still working on).
local owns = {}
if lo then
  for _, entry in ipairs(redis.call('XPENDING', input, group, lo[3], hi[3], 2147483647, consumer)) do
    owns[entry[1]] = true
  end
end

-- Pass 2: per item, decide and write.
local replies, ignored, acked, done = {}, {}, {}, {}
pos = 5
for i = 1, n_items do
  local id, dead_uid, n_out = ARGV[pos], ARGV[pos + 1], tonumber(ARGV[pos + 2])
  pos = pos + 3
  local owned = id == '' or (owns[id] and not done[id])
  local reply, first, all_done = {'ok'}, pos, n_out > 0
  for j = 1, n_out do
    local dedup, binding = tonumber(ARGV[pos + 1]), ARGV[pos + 2]
    local existing = dedup > 0 and redis.call('GET', KEYS[dedup])
    if existing then
      local marked, bound = string.match(existing, '^(%S+) ?(%S*)$')
      if marked and (binding == '' or bound == binding) then
        existing = marked
      else
        if owned then ignored[#ignored + 1] = KEYS[dedup] end
        existing = false
      end
    end
    reply[j + 1] = existing or ''
    all_done = all_done and existing ~= false
    pos = pos + 4 + 2 * tonumber(ARGV[pos + 3])
  end
  if all_done or done[id] or (not owned and not_owned(input, group, id) == 'dup') then
    reply[1] = 'dup'
  elseif not owned then
    reply[1] = 'lost'
  end
  if owned then
    local p = first
    for j = 1, n_out do
      local n_fields = tonumber(ARGV[p + 3])
      if reply[j + 1] == '' then
        local dedup, binding = tonumber(ARGV[p + 1]), ARGV[p + 2]
        local new_id = redis.call('XADD', KEYS[tonumber(ARGV[p])], '*', unpack(ARGV, p + 4, p + 3 + 2 * n_fields))
        if dedup > 0 then
          local marker = binding == '' and new_id or new_id .. ' ' .. binding
          redis.call('SET', KEYS[dedup], marker, 'PX', ttl)
        end
        reply[j + 1] = new_id
      end
      p = p + 4 + 2 * n_fields
    end
    if dead_uid ~= '' and redis.call('SREM', in_flight, dead_uid) == 1 then
      redis.call('HINCRBY', ledger, Counters.dead, 1)
    end
    if id ~= '' then
      acked[#acked + 1], done[id] = id, true
    end
  end
  replies[i] = reply
end
-- The inputs are acknowledged together, and their recorded errors removed (there are rarely any), a
-- call per 1000 (Lua's unpack).
for k = 1, #acked, 1000 do
  local ids, fields = {unpack(acked, k, math.min(k + 999, #acked))}, {}
  for j, id in ipairs(ids) do fields[j] = Errors.entry(input, id) end
  redis.call('XACK', input, group, unpack(ids))
  redis.call('HDEL', errors, unpack(fields))
end
return {replies, ignored}
