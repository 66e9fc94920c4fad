-- Evaluation: submit the eval prompt groups of an eval version once (any replica may try; the first wins).
-- They bypass back-pressure (bounded by the eval datasets' sizes) and count in the ledger like any group
-- (`submitted`, then `collected` or `dead`), so the identity holds; `eval_pending:<v>` counts those not
-- collected yet (collect.lua), which the barrier waits for.
-- KEYS[1] prompts, KEYS[2] state, KEYS[3] in-flight set, KEYS[4] ledger
-- ARGV: version, now, n_groups, then per group: uid, n_fields, f1, v1, ...
-- Returns the groups submitted (0: already submitted).
local prompts, state, in_flight, ledger = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local version, now, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('HSETNX', state, 'eval_submitted:' .. version, now) == 0 then return 0 end
local pos = 4
for _ = 1, n do
  local uid, n_fields = ARGV[pos], tonumber(ARGV[pos + 1])
  redis.call('XADD', prompts, '*', unpack(ARGV, pos + 2, pos + 1 + 2 * n_fields))
  redis.call('SADD', in_flight, uid)
  pos = pos + 2 + 2 * n_fields
end
redis.call('HSET', state, 'eval_pending:' .. version, n)
redis.call('HINCRBY', ledger, 'submitted', n)
redis.call('HINCRBY', ledger, 'eval_submitted', n)
return n
