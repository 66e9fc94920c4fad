-- Feeder: submit prompt groups at the dataset cursor, atomically with the cursor's advance.
-- Any replica may call it: the cursor is compare-and-set, so a position is submitted (or skipped) once.
-- Back-pressure: stops ('full') when undelivered + pending prompt groups reach `backlog_limit`, or the
-- ready sets are full (`pressure`: `ready_limit` batch units, of `unit` 'groups' or 'samples', and a
-- batch of `batch_size` units in each).
-- Keys, arguments and reply: `SUBMIT` in astraflow/dataflow/scripts.py; the reply's room is what the
-- feeder's next step starts from.
local prompts, state, in_flight, ledger, traces = Key.prompts, Key.state, Key.in_flight, Key.ledger, Key.traces
local expected, group, backlog_limit, ready_limit = Arg.expected, Arg.raas_group, Arg.backlog_limit, Arg.ready_limit
local prefix, ttl, now = Arg.trace_prefix, Arg.trace_ttl_s, Arg.now
local trace_max, unit, batch, trace_every = Arg.trace_max, Arg.unit, Arg.batch_size, Arg.trace_every

local cursor, notice = cursor_and_notice(state)
local backlog, ready_full = pressure(prompts, group, backlog_limit, Key.readys, unit, ready_limit, batch)
local function reply(status, submitted)
  return {status, submitted, room_reply(state, backlog_limit, backlog, ready_full, cursor, notice)}
end
if cursor ~= expected then return reply('moved', 0) end

local status, submitted = 'ok', 0
local count, flush = counter()
local uids, ranked = {}, {}  -- added to the in-flight set and the trace index in one command a 500
local function add_uids()
  if #uids > 0 then redis.call('SADD', in_flight, unpack(uids)) end
  if #ranked > 0 then redis.call('ZADD', traces, unpack(ranked)) end
  uids, ranked = {}, {}
end
for _, item in ipairs(Arg.items) do
  local uid, row, version = item.uid, item.row, item.version
  if item.submit then
    if backlog >= backlog_limit or ready_full then
      status = 'full'
      break
    end
    redis.call('XADD', prompts, '*', unpack(item.fields))
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
