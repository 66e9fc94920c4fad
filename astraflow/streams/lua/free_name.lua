-- Free a consumer name if this process still holds it. Keys, arguments and reply: `FREE_NAME` in
-- astraflow/streams/scripts.py (`streams.names`).
-- function flags: allow-oom (it frees memory or grows none: it must run while Redis is full)
if redis.call('GET', Key.name) == Arg.holder then redis.call('DEL', Key.name) end
return 1
