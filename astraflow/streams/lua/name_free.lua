-- Free a consumer name (streams/names.py), only while it still holds this holder's value.
-- KEYS[1] the name key; ARGV[1] the holder. Returns nothing.
-- function flags: allow-oom (it frees memory or grows none: it must run while Redis is full)
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
