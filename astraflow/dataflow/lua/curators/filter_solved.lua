-- filter_solved's Lua half (its Python half: `FilterSolved` in astraflow/dataflow/curators.py): a
-- success-rate EWMA per dataset row in its hash (`Key.curator_state`), moved by each group collected.
local curator = {}
function curator.collected(params, row, mean)
  local old = tonumber(redis.call('HGET', Key.curator_state, row) or mean)
  local alpha = tonumber(params.alpha)
  redis.call('HSET', Key.curator_state, row, tostring(alpha * mean + (1 - alpha) * old))
end
return curator
