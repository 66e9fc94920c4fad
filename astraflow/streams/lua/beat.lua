-- Write a worker's heartbeat hash (its fields, plus the holder under `holder_field`), expiring in
-- `ttl_ms`, only while its consumer name holds `holder`. Keys, arguments and reply: `BEAT` in
-- astraflow/streams/scripts.py (`streams.names`).
if redis.call('GET', Key.name) ~= Arg.holder then return 0 end
redis.call('DEL', Key.heartbeat)
redis.call('HSET', Key.heartbeat, Arg.holder_field, Arg.holder, unpack(Arg.fields))
redis.call('PEXPIRE', Key.heartbeat, Arg.ttl_ms)
return 1
