"""The buffer facade: writes, window sampling, priorities, state."""
