-- Elect the one process of a region that pulls a version's bytes (delta or full) over the long link.
-- KEYS[1] the relay key; ARGV: this process's endpoint, ttl ms, an endpoint seen failing ('' = none).
-- A failed relay still named in the key is unseated first. Returns the elected endpoint.
if ARGV[3] ~= '' and redis.call('GET', KEYS[1]) == ARGV[3] then
  redis.call('DEL', KEYS[1])
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return ARGV[1]
end
return redis.call('GET', KEYS[1])
