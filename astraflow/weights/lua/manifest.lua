-- A version's manifest, written whole: the hash replaced, its peers set emptied (a version republished by a
-- restarted trainer has other bytes than its peers hold), a TTL set. Idempotent: a retry writes the same.
-- Keys, arguments and reply: `MANIFEST` in astraflow/weights/scripts.py.
redis.call('DEL', Key.manifest, Key.peers)
redis.call('HSET', Key.manifest, unpack(Arg.fields))
redis.call('EXPIRE', Key.manifest, Arg.ttl_s)
return 1
