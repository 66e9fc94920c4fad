-- Release: give an owned entry back for another delivery now (its handler failed), recording why.
-- The entry is marked released (idle RELEASED_IDLE) so the next reclaim by any consumer picks it up and
-- counts the failed attempt as a delivery: a poison entry still reaches max_deliveries and `dead`.
-- KEYS[1] stream, KEYS[2] errors hash; ARGV: group, consumer, id, reason. Returns 1, or 0 if not owned.
local stream, errors = KEYS[1], KEYS[2]
local group, consumer, id, reason = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if #redis.call('XPENDING', stream, group, id, id, 1, consumer) == 0 then return 0 end
redis.call('XCLAIM', stream, group, consumer, 0, id, 'IDLE', RELEASED_IDLE, 'JUSTID')
redis.call('HSET', errors, Errors.entry(stream, id), consumer .. ': ' .. reason)
return 1
