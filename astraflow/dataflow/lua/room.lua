-- Feeder: how many prompt groups the back-pressure limits admit now, with the cursor and the notice the
-- feeder submits at (read only: submit.lua decides, this only spares the feeder encoding groups that would
-- be refused, and reading the whole state at every step).
-- KEYS[1] prompts, KEYS[2] state, KEYS[3..] ready sets
-- ARGV: raas_group, backlog_limit, ready_limit (in batch units), batch unit ('groups'/'samples'), batch size
-- Returns {room, 1 when the ready sets are what is full (else 0), cursor, notice (-1: none yet)}.
local backlog_limit, ready_limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local backlog, ready_full = pressure(KEYS[1], ARGV[1], backlog_limit, 3, ARGV[4], ready_limit, tonumber(ARGV[5]))
local at = redis.call('HMGET', KEYS[2], State.cursor, State.notice)
local cursor, notice = tonumber(at[1] or '0'), tonumber(at[2] or '-1')
if ready_full then return {0, 1, cursor, notice} end
return {math.max(0, backlog_limit - backlog), 0, cursor, notice}
