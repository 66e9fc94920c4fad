-- Helpers shared by every script (prepended to each one when it is registered, before its package's own).

-- release.lua marks an entry released (its handler failed; the next claim counts a delivery) by setting
-- its idle time to this; claim.lua and renew.lua recognise the mark.
local RELEASED_IDLE = 2147483647

-- Whether stream id a (as {ms, seq}, decimal digits) is before b: numbers of any size compare by length,
-- then digit by digit.
local function digits_before(x, y) return #x < #y or (#x == #y and x < y) end
local function id_before(a, b)
  return digits_before(a[1], b[1]) or (a[1] == b[1] and digits_before(a[2], b[2]))
end
local function id_parts(id) return {string.match(id, '^(%d+)-(%d+)$')} end

-- The id of the last entry of `stream` delivered to `group` ('0-0' when none).
local function last_delivered(stream, group)
  if redis.call('EXISTS', stream) == 0 then return '0-0' end
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then return info['last-delivered-id'] end
  end
  return '0-0'
end

-- What a caller that does not own entry `id` of `stream` (in `group`) is told of it: 'lost' when another
-- consumer holds it; 'dup' when it was handed off here - delivered to the group, and still in the stream
-- or before its first entry (trimmed: trimming drops acknowledged entries from the front, nothing deletes
-- one alone); else 'lost': this server never delivered it, or never had it (the read, or the XADD itself,
-- was lost with a primary that failed over). Nothing of a 'lost' entry's hand-off is here; it is read
-- anew if it is here at all.
local function not_owned(stream, group, id)
  if #redis.call('XPENDING', stream, group, id, id, 1) > 0 then return 'lost' end
  local at = id_parts(id)
  if id_before(id_parts(last_delivered(stream, group)), at) then return 'lost' end
  if #redis.call('XRANGE', stream, id, id) > 0 then return 'dup' end
  local first = redis.call('XRANGE', stream, '-', '+', 'COUNT', 1)[1]
  return (first == nil or id_before(at, id_parts(first[1]))) and 'dup' or 'lost'
end
