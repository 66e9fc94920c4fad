-- Take (or renew) a consumer name (streams/names.py): set it to the holder ARGV[1] for ARGV[2] ms if it is
-- free or still holds ARGV[3] (this holder's own value, or a dead holder's).
-- KEYS[1] the name key; ARGV: holder, ttl_ms, expected. Returns the other live holder, or false if taken.
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[3] then return held end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
