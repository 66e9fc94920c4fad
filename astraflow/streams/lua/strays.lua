-- Stranded prompt groups: in flight (in the in-flight set) with no entry behind them.
-- Submit, hand-off, collect and dead-lettering each move a group between its entries and the in-flight
-- set in one atomic step, so a group in flight always has an entry that the run's group of its stream has
-- not acknowledged: an undelivered or pending prompt, or an undelivered or pending rollout. One without
-- was stranded (its entries were deleted, or acknowledged without their output) and nothing would ever
-- settle it. The caller names the uids it has seen stranded for longer than lease + grace: those still
-- stranded now are dead-lettered with the reason, leave the in-flight set and count as `dead` in the
-- ledger, so `submitted == in_flight + ready + trained + dropped + dead` still holds.
-- Keys, arguments and reply: `STRAYS` in astraflow/streams/scripts.py.
local in_flight, dead, ledger = Key.in_flight, Key.dead, Key.ledger
local dead_maxlen, reason = Arg.dead_maxlen, Arg.reason

local backed = {}
local function back(fields)  -- (by the uid its `data` starts with: the plain `uid` field is for people)
  local uid = entry_uid(fields)
  if uid then backed[uid] = true end
end

for s, stream in ipairs(Key.streams) do
  local group = Arg.groups[s]
  if redis.call('EXISTS', stream) == 1 then
    local last = nil
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local info = {}
      for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
      if info['name'] == group then last = info['last-delivered-id'] end
    end
    -- Undelivered: after the group's last delivered id (everything, while the group does not exist).
    if last ~= LAST_ID then
      for _, e in ipairs(redis.call('XRANGE', stream, last and '(' .. last or '-', '+')) do back(e[2]) end
    end
    if last then
      local n = tonumber(redis.call('XPENDING', stream, group)[1])
      if n > 0 then
        for _, p in ipairs(redis.call('XPENDING', stream, group, '-', '+', n)) do
          local e = redis.call('XRANGE', stream, p[1], p[1])[1]
          if e then back(e[2]) end
        end
      end
    end
  end
end

local settled = {}
for _, uid in ipairs(Arg.uids) do
  if not backed[uid] and redis.call('SREM', in_flight, uid) == 1 then
    redis.call('HINCRBY', ledger, Counters.dead, 1)
    redis.call('XADD', dead, 'MAXLEN', '~', dead_maxlen, '*', Entry.kind, DeadLetter.kind,
      DeadLetter.source, in_flight, DeadLetter.copied(Entry.uid), uid, DeadLetter.reason, reason,
      DeadLetter.settled, uid)
    settled[#settled + 1] = uid
  end
end

local stranded = {}
for _, uid in ipairs(redis.call('SMEMBERS', in_flight)) do
  if not backed[uid] then stranded[#stranded + 1] = uid end
end
return {settled, stranded}
