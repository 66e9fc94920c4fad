-- Feeder: how many prompt groups the back-pressure limits admit now (read only: submit.lua decides, this
-- only spares the feeder encoding groups that would be refused).
-- KEYS[1] prompts, KEYS[2..] ready sets
-- ARGV: raas_group, backlog_limit, ready_limit (in batch units), batch unit ('groups'/'samples')
-- Returns {room, 1 when the ready sets are what is full (else 0)}.
local backlog_limit, ready_limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local backlog, ready = pressure(KEYS[1], ARGV[1], backlog_limit, 2, ARGV[4], ready_limit)
if ready >= ready_limit then return {0, 1} end
return {math.max(0, backlog_limit - backlog), 0}
