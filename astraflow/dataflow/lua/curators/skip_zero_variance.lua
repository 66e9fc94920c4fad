-- skip_zero_variance's Lua half (its Python half: `SkipZeroVariance` in astraflow/dataflow/curators.py):
-- per dataset row `<zero-variance groups in a row> <trainer version now>` (`Key.streak`).
local curator = {}
function curator.collected(_, row, _, zero_var, versions)
  if zero_var then
    local n = tonumber(string.match(redis.call('HGET', Key.streak, row) or '', '^(%d+) ') or '0')
    local v = 0
    for _, x in pairs(versions) do v = math.max(v, x) end
    redis.call('HSET', Key.streak, row, (n + 1) .. ' ' .. v)
  else
    redis.call('HDEL', Key.streak, row)
  end
end
return curator
