-- Helpers shared by the dataflow's scripts (prepended to each one when it is registered).

-- Entries of `stream` that `group` has not been delivered yet, counted up to `cap`.
local function undelivered(stream, group, cap)
  if redis.call('EXISTS', stream) == 0 then return 0 end
  local last = '0-0'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then last = info['last-delivered-id'] end
  end
  return #redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', cap)
end

-- Entries delivered to `group` and not acknowledged yet.
local function pending(stream, group)
  if redis.call('EXISTS', stream) == 0 then return 0 end
  local ok, summary = pcall(redis.call, 'XPENDING', stream, group)
  if not ok then return 0 end
  return tonumber(summary[1])
end

-- A ready/replay member is 'uid min_version n_samples'.
local function parse_member(member)
  local uid, minv, n = string.match(member, '^(%S+) (%-?%d+) (%d+)$')
  return uid, tonumber(minv), tonumber(n)
end

-- The trainer version of `model` (0 before its trainer published anything).
local function trainer_version(state, model)
  return tonumber(redis.call('HGET', state, 'v:' .. model) or '0')
end

-- Whether `consumer` owns entry `id` of `stream` in `group`; 'lost' or 'dup' when it does not.
local function ownership(stream, group, consumer, id)
  if #redis.call('XPENDING', stream, group, id, id, 1, consumer) > 0 then return 'ok' end
  if #redis.call('XPENDING', stream, group, id, id, 1) > 0 then return 'lost' end
  return 'dup'
end

local function trace(prefix, uid, ttl, pairs_)
  if #pairs_ == 0 then return end
  local key = prefix .. 'trace:' .. uid
  redis.call('HSET', key, unpack(pairs_))
  redis.call('EXPIRE', key, ttl)
end
