-- Helpers shared by the bus's scripts (prepended to each one when it is registered).

-- release.lua marks an entry released (its handler failed; the next claim counts a delivery) by setting
-- its idle time to this; claim.lua and renew.lua recognise the mark.
local RELEASED_IDLE = 2147483647
