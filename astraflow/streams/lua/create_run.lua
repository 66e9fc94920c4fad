-- A run's identity, created unless it exists (concurrent bootstraps agree on one).
-- KEYS[1] the run hash. ARGV: nonce, created (unix seconds). Returns {nonce, created, stopped or ''}.
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], Identity.nonce, ARGV[1], Identity.created, ARGV[2])
end
local v = redis.call('HMGET', KEYS[1], Identity.nonce, Identity.created, Identity.stopped)
return {v[1], v[2], v[3] or ''}
