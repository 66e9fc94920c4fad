-- Feeder: how many prompt groups the back-pressure limits admit now, with the cursor and the notice the
-- feeder submits at (read only: submit.lua decides, this only spares the feeder encoding groups that would
-- be refused, and reading the whole state at every step). A settle returns the same (collect.lua).
-- KEYS[1] prompts, KEYS[2] state, KEYS[3..] ready sets
-- ARGV: raas_group, backlog_limit, ready_limit (in batch units), batch unit ('groups'/'samples'), batch size
-- Returns `room` (common.lua): {room, ready sets full (1/0), cursor, notice (-1: none yet), eval due}.
return room(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), {unpack(KEYS, 3)}, ARGV[4], tonumber(ARGV[3]), tonumber(ARGV[5]))
