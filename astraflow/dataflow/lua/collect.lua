-- Collector: settle rollout groups, atomically with their XACK. Per group and model the part is put in
-- the ready set or dropped with its reason, and counted in the ledger; the prompt's curator state
-- (success EWMA, zero-variance streak) is updated when a curator reads it. The staleness check runs
-- here, against the trainer version at this instant, so no version bump slips between check and store.
-- An accepted part's bytes go to the samples hash under the rollout entry's id: passed in with the part
-- and written when it is made ready, or (large values are slow to pass into Lua) written by the caller
-- before, in one MULTI with this script ('written'), and removed again when the part ends up held by
-- nothing (dropped here, or the entry was not ours to settle).
-- Keys, arguments and reply: `COLLECT` in astraflow/dataflow/scripts.py. Reply statuses: 'ok', 'dup'
-- (already settled), 'lost' (another consumer owns the entry, or a failover lost it) or 'unknown' (its uid
-- was not in flight: a duplicate rollout, only acked). An entry's recorded error (errors hash) is removed
-- when it is acknowledged. The `records` are written only when every item settles 'ok': after a lost
-- reply the retry finds them settled, and must not count them again.
-- The curator named `curator` updates its state per group collected: its Lua half,
-- lua/curators/<name>.lua, selected by name (`curators`, assembled from those files).
-- An eval group (uid `EVAL_UID`) has no parts: it counts as `eval` (and `eval_dropped:<reason>` when its
-- trace says `eval` = `dropped: <reason>`) and lowers `eval_pending:<v>` in the state.
local rollouts, in_flight, ledger, state = Key.rollouts, Key.in_flight, Key.ledger, Key.state
local errors, metrics, prompts, models = Key.errors, Key.metrics, Key.prompts, Key.models
local group, consumer, max_staleness, prefix = Arg.group, Arg.consumer, Arg.max_staleness, Arg.trace_prefix
local ttl, order, now, written = Arg.trace_ttl_s, Arg.order, Arg.now, Arg.written
local curate = (curators[Arg.curator] or {}).collected
local params = {}
for i = 1, #Arg.curator_params, 2 do params[Arg.curator_params[i]] = Arg.curator_params[i + 1] end

local count, flush = counter()
local versions = {}  -- trainer version per model, read once
local seq = tonumber(redis.call('HGET', state, State.seq) or '0')

-- Which entries this consumer owns, in one XPENDING over the items' id range (not one per item); the
-- acknowledgements and error removals go out in one command each at the end.
local mine, lo, hi = {}, nil, nil
for _, item in ipairs(Arg.items) do
  local id = item.entry_id
  if lo == nil or sortable(id) < sortable(lo) then lo = id end
  if hi == nil or sortable(id) > sortable(hi) then hi = id end
end
if lo ~= nil then
  for _, p in ipairs(redis.call('XPENDING', rollouts, group, lo, hi, 2147483647, consumer)) do
    mine[p[1]] = true
  end
end
local acks, cleared = {}, {}
local added, passed = {}, {}  -- per ready index: its ZADD's score-member pairs, the bytes passed for them
local function push(list, a, b)
  list[#list + 1] = a
  list[#list + 1] = b
end

local replies, all_ok = {}, true
for i, item in ipairs(Arg.items) do
  local id, uid, mean, zero_var = item.entry_id, item.uid, item.mean_reward, item.zero_var
  local trace_pairs, parts = item.trace, item.parts
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
      for _, part in ipairs(parts) do
        local model, index, reason = part.model, part.index, part.reason
        local minv, n = part.min_version, part.n_samples
        versions[model] = versions[model] or trainer_version(state, model)
        if reason == '' and versions[model] - minv > max_staleness then reason = DropReason.stale_ingest end
        count(Counters.model_collected(model), 1)
        if reason == '' then
          seq = seq + 1
          local member = uid .. ' ' .. minv .. ' ' .. n .. ' ' .. id
          added[index] = added[index] or {}
          push(added[index], order == 'edf' and minv + max_staleness or seq, member)
          hold(models[index].refs, id)
          if part.payload ~= '' then
            passed[index] = passed[index] or {}
            push(passed[index], id, part.payload)
          end
          count(Counters.model_ready(model), 1)
          for _, f in ipairs({Trace.outcome(model), Outcome.ready, Trace.ready_seq(model), seq, Trace.min_version(model), minv}) do
            trace_pairs[#trace_pairs + 1] = f
          end
          reply[#reply + 1] = Outcome.ready
        else
          count(Counters.dropped(model, reason), 1)
          trace_pairs[#trace_pairs + 1] = Trace.outcome(model)
          trace_pairs[#trace_pairs + 1] = Outcome.dropped(reason)
          reply[#reply + 1] = reason
        end
      end
      local eval_version = Uid.eval_parts(uid)
      if eval_version then  -- an eval group: no parts; its scores go to the metrics stream
        count(Counters.eval, 1)
        redis.call('HINCRBY', state, State.eval_pending(eval_version), -1)
        for t = 1, #trace_pairs - 1, 2 do
          local reason = trace_pairs[t] == Trace.eval and Outcome.dropped_reason(trace_pairs[t + 1])
          if reason then count(Counters.eval_dropped(reason), 1) end
        end
      end
      local row = redis.call('HGET', prefix .. uid, Trace.row)
      if curate and row and mean ~= '' then curate(params, row, tonumber(mean), zero_var, versions) end
      trace(prefix, uid, ttl, trace_pairs)
    end
  end
  if written then  -- bytes the caller wrote for a part nothing holds (a part just made ready is held)
    for j, part in ipairs(parts) do
      local model_keys = models[part.index]
      if reply[j + 1] ~= Outcome.ready and redis.call('HEXISTS', model_keys.refs, id) == 0 then
        redis.call('HDEL', model_keys.samples, id)
      end
    end
  end
  replies[i] = reply
  all_ok = all_ok and reply[1] == 'ok'
end
for index, pairs_ in pairs(added) do redis.call('ZADD', models[index].ready, unpack(pairs_)) end
for index, pairs_ in pairs(passed) do redis.call('HSET', models[index].samples, unpack(pairs_)) end
if #acks > 0 then
  redis.call('XACK', rollouts, group, unpack(acks))
  redis.call('HDEL', errors, unpack(cleared))
end
redis.call('HSET', state, State.seq, seq)
flush(ledger)
if all_ok then
  for _, record in ipairs(Arg.records) do
    redis.call('XADD', metrics, 'MAXLEN', '~', Arg.metrics_maxlen, '*', unpack(record.fields))
  end
end
local room_now = {}
if Arg.backlog_limit then
  local readys = {}
  for _, m in ipairs(models) do readys[#readys + 1] = m.ready end
  room_now = room(prompts, state, Arg.raas_group, Arg.backlog_limit, readys, Arg.unit, Arg.ready_limit, Arg.batch_size)
end
return {all_ok and 1 or 0, replies, room_now}
