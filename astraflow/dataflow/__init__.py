"""Feeder, curators, filters, normalisation, EDF/replay, batch formation and the version barrier."""
