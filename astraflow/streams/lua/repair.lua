-- Repair a stream whose ids someone pushed past the present: an entry written with an explicit id (the
-- largest, 18446744073709551615-..., exhausts the stream: every later XADD fails). Entries past `horizon_ms`
-- beyond Redis's clock are deleted (and acknowledged in the run's group), the stream's last id is set
-- back to its newest remaining entry (or 0-1), and so is the group's last delivered id where it lay
-- beyond. A stream whose last id is within the horizon is left alone.
-- Keys, arguments and reply: `REPAIR` in astraflow/streams/scripts.py.
-- function flags: allow-oom (it frees memory or grows none: it must run while Redis is full)
local stream, group, horizon = Key.stream, Arg.group, Arg.horizon_ms
if redis.call('EXISTS', stream) == 0 then return -1 end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local limit = {string.format('%.0f', now_ms + horizon), '0'}
local info = redis.call('XINFO', 'STREAM', stream)
local last = nil
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then last = info[i + 1] end
end
if not id_before(limit, id_parts(last)) then return -1 end
local grouped = false
if group ~= '' then
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    for i = 1, #g, 2 do
      if g[i] == 'name' and g[i + 1] == group then grouped = true end
    end
  end
end
local deleted = 0
while true do
  local bogus = redis.call('XRANGE', stream, limit[1] .. '-' .. limit[2], '+', 'COUNT', 1000)
  if #bogus == 0 then break end
  local ids = {}
  for j, e in ipairs(bogus) do ids[j] = e[1] end
  if grouped then redis.call('XACK', stream, group, unpack(ids)) end
  deleted = deleted + redis.call('XDEL', stream, unpack(ids))
end
local top = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
local back = top and top[1] or '0-1'
redis.call('XSETID', stream, back)
if grouped and id_before(id_parts(back), id_parts(last_delivered(stream, group))) then
  redis.call('XGROUP', 'SETID', stream, group, back)
end
return deleted
