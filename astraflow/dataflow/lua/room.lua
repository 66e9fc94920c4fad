-- Feeder: how many prompt groups the back-pressure limits admit now, with the cursor and the notice the
-- feeder submits at (read only: submit.lua decides, this only spares the feeder encoding groups that would
-- be refused, and reading the whole state at every step). A settle returns the same (collect.lua).
-- Keys, arguments and reply: `ROOM` in astraflow/dataflow/scripts.py.
return room(Key.prompts, Key.state, Arg.raas_group, Arg.backlog_limit, Key.readys, Arg.unit, Arg.ready_limit,
  Arg.batch_size)
