"""Double buffer, delta codec, sender, receiver, relay."""
