-- Trim a grouped stream up to what the run's group has acknowledged, never further.
-- An entry is safe to drop when the run's group (`run_group`, `Keys.group_of`) delivered it (id <=
-- last-delivered-id) and it is not pending there. MINID trims entries strictly below the smallest id that
-- group still needs. Other groups on the stream are not the run's (anyone allowed XGROUP CREATE may add
-- one): waiting for them would let one idle group stop all trimming, so they are ignored.
-- It also removes from the group the consumers that hold nothing and have not been seen for
-- `forget_idle_ms`: every process start uses a new consumer name, and the old names would pile up in
-- XINFO CONSUMERS. (A live consumer removed this way is recreated by its next read; it held nothing.)
-- Keys, arguments and reply: `TRIM` in astraflow/streams/scripts.py.
-- function flags: allow-oom (it frees memory or grows none: it must run while Redis is full)
local stream, forget_idle, run_group = Key.stream, Arg.forget_idle_ms, Arg.run_group

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
local info = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  local fields = {}
  for i = 1, #g, 2 do fields[g[i]] = g[i + 1] end
  if fields['name'] == run_group then info = fields end
end
if info == nil then return 0 end
local ms, seq = string.match(info['last-delivered-id'], '^(%d+)-(%d+)$')
local keep = ms .. '-' .. string.format('%.0f', tonumber(seq) + 1)
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, run_group)) do
  local consumer = {}
  for i = 1, #c, 2 do consumer[c[i]] = c[i + 1] end
  if tonumber(consumer['pending']) == 0 and tonumber(consumer['idle']) > forget_idle then
    redis.call('XGROUP', 'DELCONSUMER', stream, run_group, consumer['name'])
  end
end
local pending = redis.call('XPENDING', stream, run_group)
if tonumber(pending[1]) > 0 and less(pending[2], keep) then keep = pending[2] end
return redis.call('XTRIM', stream, 'MINID', keep)
