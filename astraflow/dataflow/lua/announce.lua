-- Version barrier, second half: announce version v to every RaaS once all models have it.
-- Compare-and-set on the last announced version, so concurrent replicas announce each version once.
-- It clears the rollback mark (version.lua): the notice it publishes moves the RaaS pool back.
-- Announcing is also when the curator named `curator` moves its state (its Lua half's `announced`, from
-- lua/curators/<name>.lua: GRESO's submit probabilities move toward their targets once per version).
-- Keys, arguments and reply: `ANNOUNCE` in astraflow/dataflow/scripts.py.
local notices, state = Key.notices, Key.state
local expected, version, maxlen = Arg.expected, Arg.version, Arg.maxlen
local last = tonumber(redis.call('HGET', state, State.notice) or '-1')
if last ~= expected then return {'moved', last} end

redis.call('XADD', notices, 'MAXLEN', '~', maxlen, '*', unpack(Arg.notice))
redis.call('HSET', state, State.notice, version)
redis.call('HDEL', state, State.rollback)
for _, field in ipairs(Arg.forget) do redis.call('HDEL', state, field) end

local announced = (curators[Arg.curator] or {}).announced
if announced then
  local params = {}
  for i = 1, #Arg.curator_params, 2 do params[Arg.curator_params[i]] = Arg.curator_params[i + 1] end
  announced(params)
end
return {'ok', version}
