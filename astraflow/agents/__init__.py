"""Agent programs written against the OpenAI API: the endpoint that serves them, the record of their
calls, the parsing of tool calls, the running of a program (the `agent` workflow puts them together)."""
