"""Screens of the ncclscope TUI: each module is a view plus the pure function that builds its data."""
