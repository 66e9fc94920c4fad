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
-- leaves the in-flight set and, if it was there, the ledger counts it dead - once, whoever retries. The
-- in-flight set and the ledger are among `Key.outputs` (at `Arg.settle`, the ledger after it) only in a
-- call with such an item: a RaaS's hand-offs never settle a group, and its user may write neither.
--
-- Keys, arguments and reply: `HANDOFF` in astraflow/streams/scripts.py (built by `streams.handoff`). Its
-- outputs name their stream and dedup key by index in `Key.outputs`.
-- An acknowledged input's recorded error (errors hash, written by release and claim) is removed with it.
-- Reply: {replies, ignored}: one reply per item, {status, id of each output ('' when unknown)}, status
-- 'ok', 'dup' (already done: every output existed, or the input was already acknowledged) or 'lost'
-- (another consumer has it, or this server never delivered it: the read was lost in a failover); and the
-- dedup keys whose markers were ignored (not this hand-off's).

local input, errors, outputs = Key.input, Key.errors, Key.outputs
local group, consumer, ttl, items = Arg.group, Arg.consumer, Arg.ttl_ms, Arg.items
local in_flight = Arg.settle > 0 and outputs[Arg.settle]
local ledger = in_flight and outputs[Arg.settle + 1]

-- Pass 1, read-only: every output stream must be a stream (or not exist yet); the lowest and highest
-- input ids.
local checked, lo, hi = {}, nil, nil
for _, item in ipairs(items) do
  local id = item.input_id
  if item.dead_uid ~= '' and not ledger then
    return redis.error_reply('ERR an item settles ' .. item.dead_uid .. ' but no in-flight set is given')
  end
  if id ~= '' then
    local key = {string.match(id, '^(%d+)-(%d+)$')}
    if #key ~= 2 then return redis.error_reply('ERR input id ' .. id .. ' is not a stream id') end
    key[3] = id
    if not lo or id_before(key, lo) then lo = key end
    if not hi or id_before(hi, key) then hi = key end
  end
  for _, out in ipairs(item.outs) do
    local stream, n_fields = outputs[out.stream], #out.fields / 2
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
for i, item in ipairs(items) do
  local id, dead_uid = item.input_id, item.dead_uid
  local owned = id == '' or (owns[id] and not done[id])
  local reply, all_done = {'ok'}, #item.outs > 0
  for j, out in ipairs(item.outs) do
    local existing = out.dedup > 0 and redis.call('GET', outputs[out.dedup])
    if existing then
      local marked, bound = string.match(existing, '^(%S+) ?(%S*)$')
      if marked and (out.binding == '' or bound == out.binding) then
        existing = marked
      else
        if owned then ignored[#ignored + 1] = outputs[out.dedup] end
        existing = false
      end
    end
    reply[j + 1] = existing or ''
    all_done = all_done and existing ~= false
  end
  if all_done or done[id] or (not owned and not_owned(input, group, id) == 'dup') then
    reply[1] = 'dup'
  elseif not owned then
    reply[1] = 'lost'
  end
  if owned then
    for j, out in ipairs(item.outs) do
      if reply[j + 1] == '' then
        local new_id = redis.call('XADD', outputs[out.stream], '*', unpack(out.fields))
        if out.dedup > 0 then
          local marker = out.binding == '' and new_id or new_id .. ' ' .. out.binding
          redis.call('SET', outputs[out.dedup], marker, 'PX', ttl)
        end
        reply[j + 1] = new_id
      end
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
