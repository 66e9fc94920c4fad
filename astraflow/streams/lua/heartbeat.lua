-- A RaaS heartbeat (streams/names.py): replace the hash KEYS[2] with the fields ARGV[3..] (the holder's
-- among them), expiring in ARGV[2] ms, only while the name KEYS[1] holds ARGV[1].
-- KEYS[1] the name key, KEYS[2] the heartbeat; ARGV: holder, ttl_ms, field, value, ... Returns 1 if written.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
