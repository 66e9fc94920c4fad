-- Trim a grouped stream up to what every group has acknowledged, never further.
-- An entry is safe to drop when, for every group, it was delivered (id <= last-delivered-id) and is not
-- pending. MINID trims entries strictly below the smallest id some group still needs.
-- It also removes from each group the consumers that hold nothing and have not been seen for
-- `forget_idle_ms`: every process start uses a new consumer name, and the old names would pile up in
-- XINFO CONSUMERS. (A live consumer removed this way is recreated by its next read; it held nothing.)
-- KEYS[1] stream; ARGV[1] forget_idle_ms. Returns the number of entries removed.
local stream, forget_idle = KEYS[1], tonumber(ARGV[1])

local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end

if redis.call('EXISTS', stream) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', stream)
if #groups == 0 then return 0 end
local keep = nil
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  local ms, seq = string.match(info['last-delivered-id'], '^(%d+)-(%d+)$')
  local need = ms .. '-' .. string.format('%.0f', tonumber(seq) + 1)
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, info['name'])) do
    local consumer = {}
    for i = 1, #c, 2 do consumer[c[i]] = c[i + 1] end
    if tonumber(consumer['pending']) == 0 and tonumber(consumer['idle']) > forget_idle then
      redis.call('XGROUP', 'DELCONSUMER', stream, info['name'], consumer['name'])
    end
  end
  local pending = redis.call('XPENDING', stream, info['name'])
  if tonumber(pending[1]) > 0 and less(pending[2], need) then need = pending[2] end
  if keep == nil or less(need, keep) then keep = need end
end
return redis.call('XTRIM', stream, 'MINID', keep)
