-- Helpers shared by the dataflow's scripts (prepended to each one when it is registered, after
-- streams/lua/common.lua's).

-- Entries of `stream` that `group` has not been delivered yet, counted up to `cap` (small entries only:
-- XRANGE returns them whole).
local function undelivered(stream, group, cap)
  local last = last_delivered(stream, group)
  if last == LAST_ID then return 0 end
  return #redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', cap)
end

-- An entry id as a string that sorts like the id (for a lexicographic index of ids).
local function sortable(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return string.format('%016.0f-%020.0f', tonumber(ms), tonumber(seq))
end

-- Entries delivered to `group` and not acknowledged yet.
local function pending(stream, group)
  if redis.call('EXISTS', stream) == 0 then return 0 end
  local ok, summary = pcall(redis.call, 'XPENDING', stream, group)
  if not ok then return 0 end
  return tonumber(summary[1])
end

-- A ready/replay member is 'uid min_version n_samples ref'; `ref` is the field of the samples hash that
-- holds the group (the id of the rollout entry it came from).
local function parse_member(member)
  local uid, minv, n, ref = string.match(member, '^(%S+) (%-?%d+) (%d+) (%S+)$')
  return uid, tonumber(minv), tonumber(n), ref
end

-- The feeder's back-pressure: prompt groups of `prompts` not yet acknowledged by `group` (counted up to
-- `cap`), and whether the ready sets `readys` (key names) are full: they hold `ready_limit` batch units together
-- and each at least a batch (`batch` units) - else a model short of a batch would wait for the feeder and
-- the feeder for the others. A unit is a group, or a sample when `unit` is 'samples' (a group may hold
-- fewer samples than the feeder asked for).
local function pressure(prompts, group, cap, readys, unit, ready_limit, batch)
  local ready, short = 0, false
  for _, key in ipairs(readys) do
    local units = 0
    if unit ~= 'samples' then
      units = redis.call('ZCARD', key)
    else  -- a sample per group at least: `ready_limit` members tell
      for _, member in ipairs(redis.call('ZRANGE', key, 0, ready_limit - 1)) do
        local _, _, n = parse_member(member)
        units = units + n
      end
    end
    ready, short = ready + units, short or units < batch
  end
  return pending(prompts, group) + undelivered(prompts, group, cap), ready >= ready_limit and not short
end

-- The last notice if it is of an eval version whose groups no one submitted (its barrier's replica died
-- first, or a rollback's notice was marked an eval again), else -1. (An eval holds later notices back
-- until its groups are submitted: one not submitted is always the last notice's.)
local function eval_due(state, notice)
  if notice < 0 then return -1 end
  local at = redis.call('HMGET', state, State.eval(notice), State.eval_submitted(notice))
  return (at[1] and not at[2]) and notice or -1
end

-- The state's dataset cursor and last notice (-1: none yet).
local function cursor_and_notice(state)
  local at = redis.call('HMGET', state, State.cursor, State.notice)
  return tonumber(at[1] or '0'), tonumber(at[2] or '-1')
end

-- A room reply: {prompt groups that may be submitted, 1 when the ready sets are what is full (else 0),
-- the dataset cursor, the last notice, `eval_due`}, from a `pressure` of `backlog`, `ready_full`.
local function room_reply(state, backlog_limit, backlog, ready_full, cursor, notice)
  local left = ready_full and 0 or math.max(0, backlog_limit - backlog)
  return {left, ready_full and 1 or 0, cursor, notice, eval_due(state, notice)}
end

-- What the back-pressure admits now, and where (a `room_reply`).
local function room(prompts, state, group, backlog_limit, readys, unit, ready_limit, batch)
  local backlog, ready_full = pressure(prompts, group, backlog_limit, readys, unit, ready_limit, batch)
  local cursor, notice = cursor_and_notice(state)
  return room_reply(state, backlog_limit, backlog, ready_full, cursor, notice)
end

-- Reference counts of stored groups: the ready set, the replay set and each batch not yet acknowledged
-- by the trainer hold a reference; the group's bytes go when the last one is released.
local function hold(refs, ref, n)
  redis.call('HINCRBY', refs, ref, n or 1)
end

local function release(samples, refs, ref)
  if redis.call('HINCRBY', refs, ref, -1) <= 0 then
    redis.call('HDEL', refs, ref)
    redis.call('HDEL', samples, ref)
  end
end

-- `release` for many references at once: `add` each, then `flush` deletes the freed ones in two commands
-- per thousand (flush before anything may hold a freed reference again).
local function releaser(samples, refs)
  local freed = {}
  local function flush()
    if #freed > 0 then
      redis.call('HDEL', refs, unpack(freed))
      redis.call('HDEL', samples, unpack(freed))
      freed = {}
    end
  end
  local function add(ref)
    if redis.call('HINCRBY', refs, ref, -1) <= 0 then freed[#freed + 1] = ref end
    if #freed >= 1000 then flush() end
  end
  return add, flush
end

-- The trainer version of `model` (0 before its trainer published anything).
local function trainer_version(state, model)
  return tonumber(redis.call('HGET', state, State.version(model)) or '0')
end

-- Whether `consumer` owns entry `id` of `stream` in `group`; 'lost' or 'dup' when it does not.
local function ownership(stream, group, consumer, id)
  if #redis.call('XPENDING', stream, group, id, id, 1, consumer) > 0 then return 'ok' end
  return not_owned(stream, group, id)
end

-- Add to the lineage of prompt group `uid` (its hash is `traces .. uid`; `traces` comes from the caller):
-- `create` when it is submitted, which sets its retention (`ttl`, counted from then: the later steps come
-- seconds after, and an EXPIRE each would be a sixth of what a group costs Redis); later steps add to a
-- trace that still exists only (one past retention, or pushed out by `trace_max_groups`, is not brought
-- back partly).
local function trace(traces, uid, ttl, pairs_, create)
  if #pairs_ == 0 then return end
  local key = traces .. uid
  if not create and redis.call('EXISTS', key) == 0 then return end
  redis.call('HSET', key, unpack(pairs_))
  if create then redis.call('EXPIRE', key, ttl) end
end

-- Counter increments gathered during a script and written once per field at its end.
local function counter()
  local counts, order = {}, {}
  local function add(field, n)
    if counts[field] == nil then
      counts[field] = 0
      order[#order + 1] = field
    end
    counts[field] = counts[field] + n
  end
  local function flush(key)
    for _, field in ipairs(order) do
      if counts[field] ~= 0 then redis.call('HINCRBY', key, field, counts[field]) end
    end
  end
  return add, flush
end
