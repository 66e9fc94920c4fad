-- Feeder: submit prompt groups at the dataset cursor, atomically with the cursor's advance.
-- Any replica may call it: the cursor is compare-and-set, so a position is submitted (or skipped) once.
-- Back-pressure: stops ('full') when undelivered + pending prompt groups reach `backlog_limit`, or the
-- ready sets are full (`pressure`: `ready_limit` batch units, of `unit` 'groups' or 'samples', and a
-- batch of `batch_size` units in each).
-- KEYS[1] prompts, KEYS[2] state, KEYS[3] in-flight set, KEYS[4] ledger, KEYS[5] traces (sorted set of
-- the uids whose trace is kept), KEYS[6..] ready sets
-- ARGV: expected_cursor, raas_group, backlog_limit, ready_limit, trace_prefix (`Keys.trace_prefix`), trace_ttl_s, now, n_items,
--   trace_max_groups, unit, batch_size, trace_every (a trace for the positions it divides; 0: none), then
--   per item: submit ('1'/'0'), uid, row, version, n_fields, f1, v1, ...
-- Returns {status ('ok', 'full' or 'moved'), submitted, then the room left as `room` (common.lua) says
-- it: {groups, ready sets full (1/0), cursor, notice (-1: none yet), eval due}} - the feeder's next step
-- starts from it.
local prompts, state, in_flight, ledger = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local expected, group, backlog_limit, ready_limit = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local prefix, ttl, now, n_items = ARGV[5], ARGV[6], ARGV[7], tonumber(ARGV[8])
local traces, trace_max, unit, batch = KEYS[5], tonumber(ARGV[9]), ARGV[10], tonumber(ARGV[11])
local trace_every = tonumber(ARGV[12])

local cursor, notice = cursor_and_notice(state)
local backlog, ready_full = pressure(prompts, group, backlog_limit, {unpack(KEYS, 6)}, unit, ready_limit, batch)
local function reply(status, submitted)
  return {status, submitted, room_reply(state, backlog_limit, backlog, ready_full, cursor, notice)}
end
if cursor ~= expected then return reply('moved', 0) end

local status, submitted, pos = 'ok', 0, 13
local count, flush = counter()
local uids, ranked = {}, {}  -- added to the in-flight set and the trace index in one command a 500
local function add_uids()
  if #uids > 0 then redis.call('SADD', in_flight, unpack(uids)) end
  if #ranked > 0 then redis.call('ZADD', traces, unpack(ranked)) end
  uids, ranked = {}, {}
end
for _ = 1, n_items do
  local submit, uid, row, version, n_fields = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3], tonumber(ARGV[pos + 4])
  if submit == '1' then
    if backlog >= backlog_limit or ready_full then
      status = 'full'
      break
    end
    redis.call('XADD', prompts, '*', unpack(ARGV, pos + 5, pos + 4 + 2 * n_fields))
    uids[#uids + 1] = uid
    if trace_every > 0 and cursor % trace_every == 0 then  -- the later steps add to existing traces only
      ranked[#ranked + 1], ranked[#ranked + 2] = cursor, uid
      trace(prefix, uid, ttl, {Trace.row, row, Trace.submitted_version, version, Trace.submitted_at, now}, true)
    end
    backlog = backlog + 1
    submitted = submitted + 1
    count(Counters.submitted, 1)
    if #uids >= 500 then add_uids() end
  else
    count(Counters.skipped, 1)
  end
  cursor = cursor + 1
  pos = pos + 5 + 2 * n_fields
end
add_uids()
flush(ledger)
redis.call('HSET', state, State.cursor, cursor)
-- Traces beyond `trace_max_groups` go, oldest first (their TTL bounds them in time, this in space).
local excess = redis.call('ZCARD', traces) - trace_max
if excess > 0 then
  for _, old in ipairs(redis.call('ZRANGE', traces, 0, excess - 1)) do redis.call('DEL', prefix .. old) end
  redis.call('ZREMRANGEBYRANK', traces, 0, excess - 1)
end
return reply(status, submitted)
