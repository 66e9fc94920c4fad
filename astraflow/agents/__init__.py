"""Agent programs written against the OpenAI API: the endpoint, the record of their calls and the
trajectories made of them."""
