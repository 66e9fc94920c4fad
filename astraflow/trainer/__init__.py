"""Losses, the trainer loop, checkpointing and distributed setup."""
