-- A stopping relay gives up its seats, so that the next puller elects a live one at once. Deletes each
-- seat that still names its endpoint (a key another process holds meanwhile is left alone).
-- Keys, arguments and reply: `RESIGN` in astraflow/weights/scripts.py.
-- function flags: allow-oom (it frees memory or grows none: it must run while Redis is full)
local n = 0
for _, key in ipairs(Key.seats) do
  if redis.call('GET', key) == Arg.endpoint then
    redis.call('DEL', key)
    n = n + 1
  end
end
return n
