-- Hand-off: acknowledge consumed entries and publish their outputs in one atomic step.
--
-- Each item is (input entry id or '' for a plain publish, outputs). An input is acknowledged only by the
-- consumer that owns it in the group's pending list: a consumer whose entry was reclaimed by another
-- gets 'lost' and nothing of that item is written. An output with a dedup key is written at most once
-- while the key lives, so a retried call (the reply was lost) never publishes twice.
-- Every check runs before the first write: Redis does not roll back a script that fails half-way.
--
-- KEYS[1] input stream (any key of the run when there is none), KEYS[2] errors hash,
-- KEYS[3..] output streams and dedup keys, referenced by index from ARGV.
-- ARGV: group, consumer, dedup_ttl_ms, n_items, then per item:
--   input_id, n_outputs, then per output: stream_index, dedup_index (0 = none), n_fields, f1, v1, ...
-- Returns one reply per item: {status, id of each output}; status 'ok', 'dup' (already done) or 'lost'.

local input, errors = KEYS[1], KEYS[2]
local group, consumer, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])

local function key_type(k)
  local t = redis.call('TYPE', k)
  if type(t) == 'table' then t = t['ok'] end
  return t
end

-- Parse, and check every output stream's type before writing anything.
local items, pos = {}, 5
for i = 1, tonumber(ARGV[4]) do
  local item = {id = ARGV[pos], outputs = {}}
  local n_out = tonumber(ARGV[pos + 1])
  pos = pos + 2
  for j = 1, n_out do
    local stream, dedup = KEYS[tonumber(ARGV[pos])], tonumber(ARGV[pos + 1])
    local n_fields = tonumber(ARGV[pos + 2])
    local t = key_type(stream)
    if t ~= 'stream' and t ~= 'none' then
      return redis.error_reply('WRONGTYPE output ' .. stream .. ' is a ' .. t .. ', not a stream')
    end
    local fields = {}
    for f = 1, 2 * n_fields do fields[f] = ARGV[pos + 2 + f] end
    item.outputs[j] = {stream = stream, dedup = dedup > 0 and KEYS[dedup] or false, fields = fields}
    pos = pos + 3 + 2 * n_fields
  end
  items[i] = item
end

local replies = {}
for i, item in ipairs(items) do
  local owned = true
  if item.id ~= '' then
    owned = #redis.call('XPENDING', input, group, item.id, item.id, 1, consumer) > 0
  end
  local ids, all_done = {}, true
  for j, out in ipairs(item.outputs) do
    ids[j] = out.dedup and redis.call('GET', out.dedup) or false
    all_done = all_done and ids[j] ~= false
  end
  local status
  if not owned then
    status = (all_done and #item.outputs > 0) and 'dup' or 'lost'
  else
    status = (all_done and #item.outputs > 0) and 'dup' or 'ok'
    for j, out in ipairs(item.outputs) do
      if not ids[j] then
        ids[j] = redis.call('XADD', out.stream, '*', unpack(out.fields))
        if out.dedup then redis.call('SET', out.dedup, ids[j], 'PX', ttl) end
      end
    end
    if item.id ~= '' then
      redis.call('XACK', input, group, item.id)
      redis.call('HDEL', errors, input .. '|' .. item.id)
    end
  end
  local reply = {status}
  for j = 1, #item.outputs do reply[j + 1] = ids[j] or '' end
  replies[i] = reply
end
return replies
