-- Reclaim: take over entries whose owner stopped renewing for longer than the lease, and dead-letter
-- those already delivered max_deliveries times.
-- XPENDING IDLE + XCLAIM rather than XAUTOCLAIM: it tells the last owner and the delivery count before the
-- claim (both go into a dead letter), and it behaves the same on Redis 6.2 and 7.x for entries that were
-- deleted from the stream (acknowledged here, since there is nothing left to process).
-- KEYS[1] stream, KEYS[2] dead stream, KEYS[3] errors hash
-- ARGV: group, consumer, min_idle_ms, count, max_deliveries, dead_maxlen
-- Returns {id, deliveries, f1, v1, ...} for each entry now owned by `consumer`.
local stream, dead, errors = KEYS[1], KEYS[2], KEYS[3]
local group, consumer, min_idle = ARGV[1], ARGV[2], ARGV[3]
local count, max_deliveries, dead_maxlen = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]

local claimed = {}
for _, p in ipairs(redis.call('XPENDING', stream, group, 'IDLE', min_idle, '-', '+', count)) do
  local id, owner, deliveries = p[1], p[2], tonumber(p[4])
  local entry = redis.call('XRANGE', stream, id, id)[1]
  local err_field = stream .. '|' .. id
  if not entry then
    redis.call('XACK', stream, group, id)
    redis.call('HDEL', errors, err_field)
  elseif deliveries >= max_deliveries then
    local last = redis.call('HGET', errors, err_field)
    local reason = 'delivered ' .. deliveries .. ' times (max_deliveries ' .. max_deliveries .. '); '
    if last then
      reason = reason .. 'last error: ' .. last
    else
      reason = reason .. 'never acknowledged: its owners crashed or hung past the lease'
    end
    local fields = {'kind', 'dead', 'source', stream, 'source_id', id, 'group', group, 'consumer', owner,
                    'deliveries', tostring(deliveries), 'reason', reason}
    for i = 1, #entry[2], 2 do
      fields[#fields + 1] = 'field.' .. entry[2][i]
      fields[#fields + 1] = entry[2][i + 1]
    end
    redis.call('XADD', dead, 'MAXLEN', '~', dead_maxlen, '*', unpack(fields))
    redis.call('XACK', stream, group, id)
    redis.call('HDEL', errors, err_field)
  else
    -- JUSTID alone would not count a delivery; RETRYCOUNT does, since this is one.
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'RETRYCOUNT', deliveries + 1, 'JUSTID')
    local reply = {id, deliveries + 1}
    for _, v in ipairs(entry[2]) do reply[#reply + 1] = v end
    claimed[#claimed + 1] = reply
  end
end
return claimed
