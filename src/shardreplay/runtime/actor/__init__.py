"""The actor room: an actor process's loop, settings, chunker and process management."""
