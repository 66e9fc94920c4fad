-- Take or renew a consumer name: set it to `holder` (expiring in `ttl_ms`) if it is free or still holds
-- `expected` (this process's own value, or a dead holder's). Keys, arguments and reply: `TAKE_NAME` in
-- astraflow/streams/scripts.py (`streams.names`).
local held = redis.call('GET', Key.name)
if held and held ~= Arg.expected then return held end
redis.call('SET', Key.name, Arg.holder, 'PX', Arg.ttl_ms)
return false
