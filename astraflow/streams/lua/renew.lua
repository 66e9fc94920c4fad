-- Lease renewal: reset the idle time of the entries this consumer still owns.
-- Owner-checked: an entry that another consumer reclaimed is reported lost, never taken back.
-- KEYS[1] stream; ARGV: group, consumer, ids... Returns the ids this consumer no longer owns.
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local lost = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  if #redis.call('XPENDING', stream, group, id, id, 1, consumer) > 0 then
    -- JUSTID: reset the idle time without counting a delivery.
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'JUSTID')
  else
    lost[#lost + 1] = id
  end
end
return lost
