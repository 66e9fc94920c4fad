-- Free a consumer name if this process still holds it. Keys, arguments and reply: `FREE_NAME` in
-- astraflow/streams/scripts.py (`streams.names`).
if redis.call('GET', Key.name) == Arg.holder then redis.call('DEL', Key.name) end
return 1
