-- A run's identity, created unless it exists (concurrent bootstraps agree on one).
-- Keys, arguments and reply: `CREATE_RUN` in astraflow/streams/scripts.py.
if redis.call('EXISTS', Key.identity) == 0 then
  redis.call('HSET', Key.identity, Identity.nonce, Arg.nonce, Identity.created, Arg.created)
end
local v = redis.call('HMGET', Key.identity, Identity.nonce, Identity.created)
return {v[1], v[2]}
