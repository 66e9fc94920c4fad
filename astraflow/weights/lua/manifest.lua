-- A version's manifest, written whole: the hash replaced, its peers set emptied (a version republished by a
-- restarted trainer has other bytes than its peers hold), a TTL set. Idempotent: a retry writes the same.
-- KEYS[1] manifest hash, KEYS[2] peers set. ARGV: ttl_s, then field, value, ...
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
