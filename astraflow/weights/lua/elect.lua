-- Elect the one process of a region that pulls a version's bytes (delta or full) over the long link.
-- Keys, arguments and reply: `ELECT` in astraflow/weights/scripts.py. A failed relay still named in the
-- relay key is unseated first.
if Arg.failed ~= '' and redis.call('GET', Key.relay) == Arg.failed then
  redis.call('DEL', Key.relay)
end
if redis.call('SET', Key.relay, Arg.endpoint, 'NX', 'PX', Arg.ttl_ms) then
  return Arg.endpoint
end
return redis.call('GET', Key.relay)
