-- Collector: settle rollout groups, atomically with their XACK. Per group and model the part is put in
-- the ready set or dropped with its reason, and counted in the ledger; the prompt's curator state
-- (success EWMA, zero-variance streak) is updated when a curator reads it. The staleness check runs
-- here, against the trainer version at this instant, so no version bump slips between check and store.
-- An accepted part's bytes go to the samples hash under the rollout entry's id: passed in with the part
-- and written when it is made ready, or (large values are slow to pass into Lua) written by the caller
-- before, in one MULTI with this script ('written'), and removed again when the part ends up held by
-- nothing (dropped here, or the entry was not ours to settle).
-- KEYS[1] rollouts, KEYS[2] in-flight set, KEYS[3] ledger, KEYS[4] state, KEYS[5] curator ewma hash,
-- KEYS[6] curator streak hash, KEYS[7] greso hash, KEYS[8] errors hash (an acknowledged entry's recorded
-- error is removed), KEYS[9] metrics, KEYS[10] prompts, KEYS[11..] per model: ready set, samples hash, refs
-- ARGV: group, consumer, max_staleness, trace_prefix (`Keys.trace_prefix`), trace_ttl_s, order ('edf'/'fifo'), ewma_alpha, now,
--   curator ('' = none reads the state, 'filter_solved', 'greso', 'skip_zero_variance'), written ('1': the
--   caller wrote the accepted parts' bytes), n_items, then per item: entry_id, uid,
--   mean_reward ('' = none), zero_var ('1'/'0'), n_trace, trace pairs..., n_parts, then per part: model,
--   ready_index, reason ('' = accept), min_version, n_samples, bytes ('' = none passed); then metrics_maxlen, n_records, per record:
--   n_fields, field pairs... (the collector's `metrics` entries for these items, written only when every
--   item settles 'ok': after a lost reply the retry finds them settled, and must not count them again);
--   then the feeder's room: raas_group, backlog_limit ('' = not wanted), ready_limit, batch unit, batch size
-- An eval group (uid `eval:<v>:...`) has no parts: it counts as `eval` (and `eval_dropped:<reason>` when
-- its trace says `eval` = `dropped: <reason>`) and lowers `eval_pending:<v>` in the state.
-- Returns {records written (1/0), per item: {status, outcome per part...}, the feeder's `room` after the
-- settle (common.lua; {} when not wanted): a round trip less for it}; status 'ok', 'dup' (already
-- settled), 'lost' (another consumer owns the entry, or a failover lost it) or 'unknown' (its uid was not
-- in flight: a duplicate rollout, only acked).
local rollouts, in_flight, ledger, state = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ewma_key, streak_key, greso, errors, metrics, prompts = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local group, consumer, max_staleness, prefix = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local ttl, order, alpha, now, curator = ARGV[5], ARGV[6], tonumber(ARGV[7]), ARGV[8], ARGV[9]
local written, n_items = ARGV[10] == '1', tonumber(ARGV[11])

local count, flush = counter()
local versions = {}  -- trainer version per model, read once
local seq = tonumber(redis.call('HGET', state, State.seq) or '0')

local function update_curator(uid, mean, zero_var)
  local row = redis.call('HGET', prefix .. uid, Trace.row)
  if not row or mean == '' then return end
  local m = tonumber(mean)
  if curator == 'filter_solved' then
    local old = tonumber(redis.call('HGET', ewma_key, row) or mean)
    redis.call('HSET', ewma_key, row, tostring(alpha * m + (1 - alpha) * old))
  elseif curator == 'greso' then
    redis.call('HINCRBY', greso, Greso.collected, 1)
    if zero_var then
      local kind = m >= 0.5 and 'easy' or 'hard'
      local n, was = string.match(redis.call('HGET', streak_key, row) or '', '^(%d+) (%a+)$')
      local streak = was == kind and tonumber(n) or 0
      redis.call('HSET', streak_key, row, (streak + 1) .. ' ' .. kind)
      redis.call('HINCRBY', greso, Greso.zero_var(kind), 1)
    else
      redis.call('HDEL', streak_key, row)
    end
  elseif curator == 'skip_zero_variance' then
    if zero_var then  -- `<zero-variance groups in a row> <trainer version now>`
      local n = tonumber(string.match(redis.call('HGET', streak_key, row) or '', '^(%d+) ') or '0')
      local v = 0
      for _, x in pairs(versions) do v = math.max(v, x) end
      redis.call('HSET', streak_key, row, (n + 1) .. ' ' .. v)
    else
      redis.call('HDEL', streak_key, row)
    end
  end
end

-- Which entries this consumer owns, in one XPENDING over the items' id range (not one per item); the
-- acknowledgements and error removals go out in one command each at the end.
local mine, lo, hi = {}, nil, nil
do
  local at = 12
  for _ = 1, n_items do
    local id = ARGV[at]
    if lo == nil or sortable(id) < sortable(lo) then lo = id end
    if hi == nil or sortable(id) > sortable(hi) then hi = id end
    at = at + 5 + 2 * tonumber(ARGV[at + 4])
    at = at + 1 + 6 * tonumber(ARGV[at])
  end
  if lo ~= nil then
    for _, p in ipairs(redis.call('XPENDING', rollouts, group, lo, hi, 2147483647, consumer)) do
      mine[p[1]] = true
    end
  end
end
local acks, cleared = {}, {}
local added, passed = {}, {}  -- per ready index: its ZADD's score-member pairs, the bytes passed for them
local function push(list, a, b)
  list[#list + 1] = a
  list[#list + 1] = b
end

local replies, pos, all_ok = {}, 12, true
for i = 1, n_items do
  local id, uid, mean, zero_var = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3] == '1'
  local n_trace = tonumber(ARGV[pos + 4])
  local trace_pairs = {unpack(ARGV, pos + 5, pos + 4 + 2 * n_trace)}
  pos = pos + 5 + 2 * n_trace
  local n_parts = tonumber(ARGV[pos])
  local parts_at = pos + 1
  pos = parts_at + 6 * n_parts
  local status = 'ok'
  if acks[id] then  -- the same entry twice in one call
    status = 'dup'
  elseif not mine[id] then  -- another consumer's ('lost'), settled already ('dup') or never read here
    status = not_owned(rollouts, group, id)
  end
  local reply = {status}
  if status == 'ok' then
    mine[id] = nil  -- the same entry twice in one call: the second is a 'dup'
    acks[#acks + 1], acks[id] = id, true
    cleared[#cleared + 1] = Errors.entry(rollouts, id)
    if redis.call('SREM', in_flight, uid) == 0 then
      count(Counters.unknown, 1)
      reply[1] = 'unknown'
    else
      count(Counters.collected, 1)
      trace_pairs[#trace_pairs + 1] = Trace.collected_at
      trace_pairs[#trace_pairs + 1] = now
      for j = 0, n_parts - 1 do
        local p = parts_at + 6 * j
        local model, index, reason = ARGV[p], tonumber(ARGV[p + 1]), ARGV[p + 2]
        local minv, n = tonumber(ARGV[p + 3]), ARGV[p + 4]
        versions[model] = versions[model] or trainer_version(state, model)
        if reason == '' and versions[model] - minv > max_staleness then reason = 'stale_ingest' end
        count(Counters.model_collected(model), 1)
        if reason == '' then
          seq = seq + 1
          local member = uid .. ' ' .. minv .. ' ' .. n .. ' ' .. id
          added[index] = added[index] or {}
          push(added[index], order == 'edf' and minv + max_staleness or seq, member)
          hold(KEYS[index + 2], id)
          if ARGV[p + 5] ~= '' then
            passed[index] = passed[index] or {}
            push(passed[index], id, ARGV[p + 5])
          end
          count(Counters.model_ready(model), 1)
          for _, f in ipairs({Trace.outcome(model), 'ready', Trace.ready_seq(model), seq, Trace.min_version(model), minv}) do
            trace_pairs[#trace_pairs + 1] = f
          end
          reply[#reply + 1] = 'ready'
        else
          count(Counters.dropped(model, reason), 1)
          trace_pairs[#trace_pairs + 1] = Trace.outcome(model)
          trace_pairs[#trace_pairs + 1] = 'dropped: ' .. reason
          reply[#reply + 1] = reason
        end
      end
      local eval_version = string.match(uid, '^eval:(%d+):')
      if eval_version then  -- an eval group: no parts; its scores go to the metrics stream
        count(Counters.eval, 1)
        redis.call('HINCRBY', state, State.eval_pending(eval_version), -1)
        for t = 1, #trace_pairs - 1, 2 do
          local reason = trace_pairs[t] == Trace.eval and string.match(trace_pairs[t + 1], '^dropped: (.+)$')
          if reason then count(Counters.eval_dropped(reason), 1) end
        end
      end
      if curator ~= '' then update_curator(uid, mean, zero_var) end
      trace(prefix, uid, ttl, trace_pairs)
    end
  end
  if written then  -- bytes the caller wrote for a part nothing holds (a part just made ready is held)
    for j = 0, n_parts - 1 do
      local index = tonumber(ARGV[parts_at + 6 * j + 1])
      if reply[j + 2] ~= 'ready' and redis.call('HEXISTS', KEYS[index + 2], id) == 0 then
        redis.call('HDEL', KEYS[index + 1], id)
      end
    end
  end
  replies[i] = reply
  all_ok = all_ok and reply[1] == 'ok'
end
for index, pairs_ in pairs(added) do redis.call('ZADD', KEYS[index], unpack(pairs_)) end
for index, pairs_ in pairs(passed) do redis.call('HSET', KEYS[index + 1], unpack(pairs_)) end
if #acks > 0 then
  redis.call('XACK', rollouts, group, unpack(acks))
  redis.call('HDEL', errors, unpack(cleared))
end
redis.call('HSET', state, State.seq, seq)
flush(ledger)
local maxlen, n_records = ARGV[pos], tonumber(ARGV[pos + 1])
pos = pos + 2
for _ = 1, n_records do
  local n_fields = tonumber(ARGV[pos])
  if all_ok then redis.call('XADD', metrics, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, pos + 1, pos + 2 * n_fields)) end
  pos = pos + 1 + 2 * n_fields
end
local room_now = {}
if ARGV[pos + 1] ~= '' then
  local readys = {}
  for i = 11, #KEYS, 3 do readys[#readys + 1] = KEYS[i] end
  room_now = room(prompts, state, ARGV[pos], tonumber(ARGV[pos + 1]), readys, ARGV[pos + 3], tonumber(ARGV[pos + 2]), tonumber(ARGV[pos + 4]))
end
return {all_ok and 1 or 0, replies, room_now}
