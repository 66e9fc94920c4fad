-- Evaluation: submit the eval prompt groups of an eval version once (any replica may try; the first wins).
-- They bypass back-pressure (bounded by the eval datasets' sizes) and count in the ledger like any group
-- (`submitted`, then `collected` or `dead`), so the identity holds; `eval_pending:<v>` counts those not
-- collected yet (collect.lua), which the barrier waits for. A `kind=eval_submitted` metrics entry per
-- dataset says how many rows its eval has (a run stopped mid-eval reports the rows scored of these).
-- KEYS[1] prompts, KEYS[2] state, KEYS[3] in-flight set, KEYS[4] ledger, KEYS[5] metrics
-- ARGV: version, now, n_groups, metrics_maxlen, n_datasets, then per dataset: name, rows; then per
--   group: uid, n_fields, f1, v1, ...
-- Returns the groups submitted (0: already submitted).
local prompts, state, in_flight, ledger, metrics = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local version, now, n, maxlen = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
if redis.call('HSETNX', state, State.eval_submitted(version), now) == 0 then return 0 end
local pos = 6
for _ = 1, tonumber(ARGV[5]) do
  redis.call('XADD', metrics, 'MAXLEN', '~', maxlen, '*', Entry.kind, MetricEntry.kind_eval_submitted,
    Entry.version, version, MetricEntry.dataset, ARGV[pos], MetricEntry.rows, ARGV[pos + 1], MetricEntry.time, now)
  pos = pos + 2
end
for _ = 1, n do
  local uid, n_fields = ARGV[pos], tonumber(ARGV[pos + 1])
  redis.call('XADD', prompts, '*', unpack(ARGV, pos + 2, pos + 1 + 2 * n_fields))
  redis.call('SADD', in_flight, uid)
  pos = pos + 2 + 2 * n_fields
end
redis.call('HSET', state, State.eval_pending(version), n)
redis.call('HINCRBY', ledger, Counters.submitted, n)
redis.call('HINCRBY', ledger, Counters.eval_submitted, n)
return n
