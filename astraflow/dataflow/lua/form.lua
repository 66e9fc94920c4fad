-- Batch former, one model: expire ready groups that went stale while waiting, take the earliest
-- deadlines (or the oldest arrivals) plus a share of the replay set, write one batch entry, and move the
-- trained groups into the bounded replay set - one atomic step. Groups are never split.
-- A batch entry refers to its groups (fields of the samples hash, see `hold`/`release`): the bytes stay
-- put until the trainer has acknowledged every batch holding them.
-- Keys, arguments and reply: `FORM` in astraflow/dataflow/scripts.py. The identity's nonce is part of
-- every batch uid (`model:nonce:n`), so no batch of another run of this name passes for one of this run.
-- The formed index holds the batches not yet acknowledged, by id (member 'sortable_id id ref1 ref2 ...').
local ready, samples, refs, replay, batches = Key.ready, Key.samples, Key.refs, Key.replay, Key.batches
local ledger, state, formed, identity = Key.ledger, Key.state, Key.formed, Key.identity
local model, max_staleness, size, unit = Arg.model, Arg.max_staleness, Arg.size, Arg.unit
local replay_quota, selection, capacity, prefetch = Arg.replay_quota, Arg.selection, Arg.capacity, Arg.prefetch
local trainer_group, prefix, ttl, order, now = Arg.trainer_group, Arg.trace_prefix, Arg.trace_ttl_s, Arg.order, Arg.now

local nonce = redis.call('HGET', identity, Identity.nonce)  -- before any write: an error here changes nothing
if not nonce then return redis.error_reply('ERR run not bootstrapped: no identity at ' .. identity) end
local version = trainer_version(state, model)
local count, flush = counter()

-- Release the groups of batches the trainer has acknowledged (delivered and no longer pending). The
-- trainer acknowledges batches only once a checkpoint holds them, so dozens may be delivered and still
-- pending: one XPENDING over their id range tells which, not one per batch (called many times a step).
local delivered_to = '[' .. sortable(last_delivered(batches, trainer_group)) .. '~'
local delivered = redis.call('ZRANGEBYLEX', formed, '-', delivered_to)
if #delivered > 0 then
  local first = string.match(delivered[1], '^%S+ (%S+)')
  local last = string.match(delivered[#delivered], '^%S+ (%S+)')
  local still, done = {}, {}
  for _, p in ipairs(redis.call('XPENDING', batches, trainer_group, first, last, 2147483647)) do
    still[p[1]] = true
  end
  local free, freed = releaser(samples, refs)
  for _, member in ipairs(delivered) do
    local words = {}
    for w in string.gmatch(member, '%S+') do words[#words + 1] = w end
    if not still[words[2]] then
      for k = 3, #words do free(words[k]) end
      done[#done + 1] = member
      if #done >= 1000 then redis.call('ZREM', formed, unpack(done)); done = {} end
    end
  end
  freed()
  if #done > 0 then redis.call('ZREM', formed, unpack(done)) end
end

-- Expire what went stale while waiting (also when the prefetch is full: it frees the ready set). A
-- group still ready is trained after every batch formed and not yet delivered, each a version on: at
-- `trained_at` or later, the least version it can be trained at.
local undelivered = redis.call('ZLEXCOUNT', formed, '(' .. string.sub(delivered_to, 2), '+')
local trained_at = version + undelivered
local expired = {}
if order == 'edf' then
  expired = redis.call('ZRANGEBYSCORE', ready, '-inf', '(' .. trained_at)  -- deadline < trained_at
else
  for _, member in ipairs(redis.call('ZRANGE', ready, 0, -1)) do
    local _, minv = parse_member(member)
    if trained_at - minv > max_staleness then expired[#expired + 1] = member end
  end
end
-- One sequence number each (taken together), one ZREM and one HDEL per hash for them all.
local first_seq = #expired > 0 and redis.call('HINCRBY', state, State.seq, #expired) - #expired or 0
local free, freed = releaser(samples, refs)
for i, member in ipairs(expired) do
  local uid, _, _, ref = parse_member(member)
  free(ref)
  trace(prefix, uid, ttl, {Trace.outcome(model), Outcome.dropped(DropReason.stale_wait), Trace.expired_seq(model), first_seq + i})
end
freed()
for k = 1, #expired, 1000 do redis.call('ZREM', ready, unpack(expired, k, math.min(k + 999, #expired))) end
count(Counters.model_ready(model), -#expired)
count(Counters.dropped(model, DropReason.stale_wait), #expired)

if undelivered >= prefetch then
  flush(ledger)
  return {'full', '', 0, 0, #expired, 0}
end

local function units(n) return unit == 'samples' and n or 1 end

-- Replay share first: it decides how many fresh units the batch needs.
local replayed, replayed_units = {}, 0
local candidates = {}
if replay_quota > 0 then
  if selection == 'latest' then
    candidates = redis.call('ZREVRANGE', replay, 0, -1)
  else
    local all, taken = redis.call('ZRANGE', replay, 0, -1), {}
    for _, r in ipairs(Arg.randoms) do
      if #candidates == #all then break end
      local k = math.floor(r * #all) + 1
      while taken[k] do k = k % #all + 1 end  -- next free one: distinct picks
      taken[k] = true
      candidates[#candidates + 1] = all[k]
    end
  end
end
for _, member in ipairs(candidates) do
  if replayed_units >= replay_quota then break end
  local _, _, n = parse_member(member)
  replayed[#replayed + 1] = member
  replayed_units = replayed_units + units(n)
end

local fresh, fresh_units, left_units = {}, 0, 0  -- left: ready units past this batch
for _, member in ipairs(redis.call('ZRANGE', ready, 0, -1)) do
  local _, _, n = parse_member(member)
  if fresh_units + replayed_units >= size then
    left_units = left_units + units(n)
  else
    fresh[#fresh + 1] = member
    fresh_units = fresh_units + units(n)
  end
end
if fresh_units + replayed_units < size then
  flush(ledger)
  return {'wait', '', 0, 0, #expired, size - fresh_units - replayed_units}
end

local seq = redis.call('HINCRBY', state, State.seq, 1)
local batch_uid = Uid.batch(model, nonce, redis.call('HINCRBY', state, State.batches(model), 1))
local uids, replayed_uids, batch_refs = {}, {}, {}
for _, member in ipairs(fresh) do
  local uid, _, _, ref = parse_member(member)
  uids[#uids + 1] = uid
  batch_refs[#batch_refs + 1] = ref
end
for _, member in ipairs(replayed) do
  local uid, _, _, ref = parse_member(member)
  uids[#uids + 1] = uid
  replayed_uids[#replayed_uids + 1] = uid
  batch_refs[#batch_refs + 1] = ref
  hold(refs, ref)  -- held by the batch too
end
local refs_text = table.concat(batch_refs, ' ')
local batch_id = redis.call('XADD', batches, '*', Entry.kind, BatchEntry.kind, Entry.schema, BatchEntry.schema,
  Entry.uid, batch_uid, Entry.model, model, Entry.version, version, BatchEntry.seq, seq,
  BatchEntry.groups, table.concat(uids, ' '), BatchEntry.replayed, table.concat(replayed_uids, ' '),
  BatchEntry.refs, refs_text)
redis.call('ZADD', formed, 0, sortable(batch_id) .. ' ' .. batch_id .. ' ' .. refs_text)
redis.call('HSET', state, State.batch_version(model), version)

for _, member in ipairs(fresh) do
  local uid, _, _, ref = parse_member(member)
  redis.call('ZREM', ready, member)  -- the ready set's reference passes to the batch
  count(Counters.model_ready(model), -1)
  count(Counters.model_trained(model), 1)
  trace(prefix, uid, ttl, {Trace.outcome(model), Outcome.trained, Trace.batch(model), batch_uid,
    Trace.batch_version(model), version, Trace.batch_seq(model), seq, Trace.batched_at(model), now})
  if capacity > 0 then
    redis.call('ZADD', replay, seq, member)
    hold(refs, ref)
  end
end
count(Counters.model_replayed(model), #replayed)
flush(ledger)
-- Bound the replay set: the oldest trained groups leave first.
local excess = redis.call('ZCARD', replay) - capacity
if excess > 0 then
  for _, member in ipairs(redis.call('ZRANGE', replay, 0, excess - 1)) do
    local _, _, _, ref = parse_member(member)
    redis.call('ZREM', replay, member)
    release(samples, refs, ref)
  end
end
return {'ok', batch_uid, #fresh, #replayed, #expired, math.max(0, size - replayed_units - left_units)}
