-- A stopping relay gives up its seats, so that the next puller elects a live one at once.
-- KEYS: relay keys this process won; ARGV[1] its endpoint. Deletes each key that still names it (a key
-- another process holds meanwhile is left alone). Returns how many it deleted.
-- function flags: allow-oom (it frees memory or grows none: it must run while Redis is full)
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    n = n + 1
  end
end
return n
