-- GRESO's Lua half (its Python half: `Greso` in astraflow/dataflow/curators.py). Per dataset row its
-- zero-variance streak and kind (`Key.streak`: '<groups in a row> <kind>'); in its hash (`Key.curator_state`)
-- the groups collected and those of zero variance per kind since the last announcement, and the
-- submit probability per kind, moved toward its target share once per version announced.
local curator = {}
function curator.collected(_, row, mean, zero_var)
  redis.call('HINCRBY', Key.curator_state, Greso.collected, 1)
  if zero_var then
    local kind = mean >= 0.5 and GresoKind.easy or GresoKind.hard
    local n, was = string.match(redis.call('HGET', Key.streak, row) or '', '^(%d+) (%a+)$')
    local streak = was == kind and tonumber(n) or 0
    redis.call('HSET', Key.streak, row, (streak + 1) .. ' ' .. kind)
    redis.call('HINCRBY', Key.curator_state, Greso.zero_var(kind), 1)
  else
    redis.call('HDEL', Key.streak, row)
  end
end
function curator.announced(params)
  local collected = tonumber(redis.call('HGET', Key.curator_state, Greso.collected) or '0')
  if collected == 0 then return end
  for _, kind in ipairs({GresoKind.easy, GresoKind.hard}) do
    local target = tonumber(params['target_' .. kind])
    local share = tonumber(redis.call('HGET', Key.curator_state, Greso.zero_var(kind)) or '0') / collected
    local p = tonumber(redis.call('HGET', Key.curator_state, Greso.p(kind)) or params.p_init)
    -- Too many zero-variance groups of this kind: submit such prompts less often, else more often.
    if share > target then p = p - tonumber(params.step) else p = p + tonumber(params.step) end
    redis.call('HSET', Key.curator_state, Greso.p(kind), tostring(math.min(1, math.max(tonumber(params.floor), p))))
    redis.call('HSET', Key.curator_state, Greso.zero_var(kind), 0)
  end
  redis.call('HSET', Key.curator_state, Greso.collected, 0)
end
return curator
