-- Helpers shared by every script (prepended to each one when it is registered, before its package's own).

-- release.lua marks an entry released (its handler failed; the next claim counts a delivery) by setting
-- its idle time to this; claim.lua and renew.lua recognise the mark.
local RELEASED_IDLE = 2147483647

-- The largest stream id. Nothing lies after it, and XRANGE and XPENDING refuse an exclusive start of it
-- ('(' .. LAST_ID): an entry of it exhausts its stream (written by someone: docs/security.md).
local LAST_ID = '18446744073709551615-18446744073709551615'

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

-- The prompt group an entry belongs to: the `uid` its msgpack `data` starts with (a message packs its
-- fields in order, `uid` first), or nil. Never the plain `uid` field beside it, which is for people: an
-- entry whose `data` does not start so belongs to no group, and settles or backs none. `astraflow.
-- streams.entries.entry_uid` reads the same.
local function msgpack_str(s, pos)  -- a msgpack str at `pos`: its text and the position after it
  local b = string.byte(s, pos)
  local n, at
  if not b then return nil
  elseif b >= 0xa0 and b <= 0xbf then n, at = b - 0xa0, pos + 1
  elseif b == 0xd9 then n, at = string.byte(s, pos + 1), pos + 2
  elseif b == 0xda then
    local h, l = string.byte(s, pos + 1, pos + 2)
    if l then n, at = h * 256 + l, pos + 3 end
  end
  if not n or at + n - 1 > #s then return nil end
  return string.sub(s, at, at + n - 1), at + n
end
local function entry_uid(fields)
  for i = 1, #fields, 2 do
    if fields[i] == Entry.data then
      local data = fields[i + 1]
      local b, pos = string.byte(data, 1), nil  -- a map of 1-15 fields, or map16, or map32
      if b and b > 0x80 and b <= 0x8f then pos = 2 elseif b == 0xde then pos = 4
      elseif b == 0xdf then pos = 6 end
      if not pos then return nil end
      local key, at = msgpack_str(data, pos)
      if key ~= Entry.uid then return nil end
      return (msgpack_str(data, at))
    end
  end
  return nil
end
