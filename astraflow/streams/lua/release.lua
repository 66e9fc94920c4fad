-- Release: give an owned entry back for another delivery now (its handler failed), recording why.
-- The entry is marked released (idle RELEASED_IDLE) so the next reclaim by any consumer picks it up and
-- counts the failed attempt as a delivery: a poison entry still reaches max_deliveries and `dead`.
-- Keys, arguments and reply: `RELEASE` in astraflow/streams/scripts.py.
local stream, errors = Key.stream, Key.errors
local group, consumer, id, reason = Arg.group, Arg.consumer, Arg.id, Arg.reason
if #redis.call('XPENDING', stream, group, id, id, 1, consumer) == 0 then return 0 end
redis.call('XCLAIM', stream, group, consumer, 0, id, 'IDLE', RELEASED_IDLE, 'JUSTID')
redis.call('HSET', errors, Errors.entry(stream, id), consumer .. ': ' .. reason)
return 1
