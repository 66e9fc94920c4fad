-- Lease renewal: reset the idle time of the entries this consumer still owns.
-- Owner-checked: an entry that another consumer reclaimed is reported lost, never taken back. An entry
-- this consumer is releasing (release.lua marked it with RELEASED_IDLE) keeps its mark: a renewal racing
-- the release must not turn the failed attempt into one that never happened.
-- Keys, arguments and reply: `RENEW` in astraflow/streams/scripts.py.
-- function flags: allow-oom (it frees memory or grows none: it must run while Redis is full)
local stream, group, consumer = Key.stream, Arg.group, Arg.consumer
local lost = {}
for _, id in ipairs(Arg.ids) do
  local p = redis.call('XPENDING', stream, group, id, id, 1, consumer)[1]
  if not p then
    lost[#lost + 1] = id
  elseif tonumber(p[3]) < RELEASED_IDLE then
    -- JUSTID: reset the idle time without counting a delivery.
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'JUSTID')
  end
end
return lost
