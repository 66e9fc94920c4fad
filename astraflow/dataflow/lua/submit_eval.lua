-- Evaluation: submit the eval prompt groups of an eval version once (any replica may try; the first wins).
-- They bypass back-pressure (bounded by the eval datasets' sizes) and count in the ledger like any group
-- (`submitted`, then `collected` or `dead`), so the identity holds; `eval_pending:<v>` counts those not
-- collected yet (collect.lua), which the barrier waits for. A `kind=eval_submitted` metrics entry per
-- dataset says how many rows its eval has (a run stopped mid-eval reports the rows scored of these).
-- Keys, arguments and reply: `SUBMIT_EVAL` in astraflow/dataflow/scripts.py.
local prompts, state, in_flight, ledger, metrics = Key.prompts, Key.state, Key.in_flight, Key.ledger, Key.metrics
local version, now, n, maxlen = Arg.version, Arg.now, #Arg.groups, Arg.metrics_maxlen
if redis.call('HSETNX', state, State.eval_submitted(version), now) == 0 then return 0 end
for _, d in ipairs(Arg.datasets) do
  redis.call('XADD', metrics, 'MAXLEN', '~', maxlen, '*', Entry.kind, MetricEntry.kind_eval_submitted,
    Entry.version, version, MetricEntry.dataset, d.name, MetricEntry.rows, d.rows, MetricEntry.time, now)
end
for _, g in ipairs(Arg.groups) do
  redis.call('XADD', prompts, '*', unpack(g.fields))
  redis.call('SADD', in_flight, g.uid)
end
redis.call('HSET', state, State.eval_pending(version), n)
redis.call('HINCRBY', ledger, Counters.submitted, n)
redis.call('HINCRBY', ledger, Counters.eval_submitted, n)
return n
