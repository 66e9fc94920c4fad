-- Version barrier, second half: announce version v to every RaaS once all models have it.
-- Compare-and-set on the last announced version, so concurrent replicas announce each version once.
-- It clears the rollback mark (version.lua): the notice it publishes moves the RaaS pool back.
-- Announcing is also when GRESO's submit probabilities move toward their targets (once per version).
-- KEYS[1] notices stream, KEYS[2] state, KEYS[3] greso hash
-- ARGV: expected_last ('-1' = none yet), version, notices_maxlen, greso ('1'/'0'), p_init, step, p_min,
--   target_easy, target_hard, n_forget, state fields to delete..., then the notice's fields f1, v1, ...
-- Returns {status ('ok'/'moved'), the last announced version}.
local notices, state, greso = KEYS[1], KEYS[2], KEYS[3]
local expected, version, maxlen = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local last = tonumber(redis.call('HGET', state, State.notice) or '-1')
if last ~= expected then return {'moved', last} end

local n_forget = tonumber(ARGV[10])
redis.call('XADD', notices, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, 11 + n_forget))
redis.call('HSET', state, State.notice, version)
redis.call('HDEL', state, State.rollback)
for i = 11, 10 + n_forget do redis.call('HDEL', state, ARGV[i]) end

if ARGV[4] == '1' then
  local p_init, step, p_min = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  local collected = tonumber(redis.call('HGET', greso, Greso.collected) or '0')
  if collected > 0 then
    for _, kind in ipairs({'easy', 'hard'}) do
      local target = tonumber(ARGV[kind == 'easy' and 8 or 9])
      local share = tonumber(redis.call('HGET', greso, Greso.zero_var(kind)) or '0') / collected
      local p = tonumber(redis.call('HGET', greso, Greso.p(kind)) or p_init)
      -- Too many zero-variance groups of this kind: submit such prompts less often, else more often.
      if share > target then p = p - step else p = p + step end
      redis.call('HSET', greso, Greso.p(kind), tostring(math.min(1, math.max(p_min, p))))
      redis.call('HSET', greso, Greso.zero_var(kind), 0)
    end
    redis.call('HSET', greso, Greso.collected, 0)
  end
end
return {'ok', version}
